"""Messages between expert-parallel ranks (parallel/wire.py): plain data and tensors, never pickles.

Round trips are compared field by field with the originals (dtype, shape and bytes of every tensor);
a pickle, a class outside the registry and truncated or forged buffers are refused with a WireError.
"""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from expertcache.layers.attention import AttnBatch
from expertcache.parallel import static_placement
from expertcache.parallel.wire import WireError, decode, encode


def _batch():
    return AttnBatch(
        positions=torch.arange(5),
        slot_mapping=torch.tensor([3, 4, 5, 6, 7]),
        block_tables=torch.tensor([[1, 2], [3, 0]]),
        seq_of_token=torch.tensor([0, 0, 0, 1, 1]),
        row_of_token=torch.tensor([0, 1, 2, 0, 1]),
        max_q=3,
        query_pos=torch.tensor([[0, 1, 2], [3, 4, 0]]),
    )


def test_step_message_round_trips_exactly():
    placement = static_placement([1, 2], 8, 3)
    tensors = {
        str(dt): (torch.randn(3, 4) * 100).to(dt)
        for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.int32)
    }
    msg = (
        "forward",
        torch.tensor([[5, 6, 7]]),
        _batch(),
        {
            "placement": placement,
            "copies": [(1, 2), (3, 4)],
            "gather": True,
            "none": None,
            "inf": float("inf"),
            "text": "ü 世界",
            "tensors": tensors,
            "empty": torch.zeros(0, 7),
            "mask": torch.tensor([True, False, True]),
            3: "int key",
        },
    )
    got = decode(encode(msg))
    assert got[0] == "forward" and torch.equal(got[1], msg[1]) and got[1].dtype == torch.int64
    assert type(got[2]) is AttnBatch and got[2].max_q == 3
    for a, b in zip(got[2], msg[2]):
        assert (a == b) if not isinstance(b, torch.Tensor) else (torch.equal(a, b) and a.dtype == b.dtype)
    ctl = got[3]
    assert ctl["placement"] == placement and ctl["placement"].replicas[2][5] == (2,)
    assert ctl["copies"] == [(1, 2), (3, 4)] and ctl["gather"] is True and ctl["none"] is None
    assert ctl["inf"] == float("inf") and ctl["text"] == "ü 世界" and ctl[3] == "int key"
    for name, t in tensors.items():
        dt = t.dtype
        assert ctl["tensors"][name].dtype == dt
        assert torch.equal(ctl["tensors"][name].view(torch.uint8), t.view(torch.uint8))
    assert ctl["empty"].shape == (0, 7) and torch.equal(ctl["mask"], msg[3]["mask"])


def test_numpy_counters_arrive_as_numbers():
    import numpy as np

    got = decode(encode({"hits": np.int64(7), "rate": np.float64(0.5), "per_layer": np.arange(3)}))
    assert got == {"hits": 7, "rate": 0.5, "per_layer": [0, 1, 2]} and type(got["hits"]) is int


def test_dtype_keys_are_not_a_way_in():
    # a dtype is not plain data: refused like any other object
    with pytest.raises(WireError, match="cannot send a dtype"):
        encode({"k": torch.float32})


def test_pickles_and_unregistered_classes_are_refused():
    class Evil:
        def __reduce__(self):
            return (print, ("ran",))

    with pytest.raises(WireError, match="cannot send a Evil"):
        encode(Evil())
    with pytest.raises(WireError, match="not JSON"):
        blob = pickle.dumps(Evil())
        decode(torch.tensor(list(len(blob).to_bytes(8, "little")) + list(blob), dtype=torch.uint8))


def _forge(tree, payload=b""):
    head = json.dumps(tree).encode()
    return torch.tensor(list(len(head).to_bytes(8, "little")) + list(head) + list(payload), dtype=torch.uint8)


@pytest.mark.parametrize(
    "tree, payload, match",
    [
        ({"$type": "Popen", "fields": {"$dict": []}}, b"", "malformed"),
        ({"$tensor": ["float32", [4], 0]}, b"\0" * 8, "outside the message"),
        ({"$tensor": ["object", [1], 0]}, b"\0" * 8, "malformed"),
        ({"$tensor": ["uint8", [2], -1]}, b"\0" * 8, "outside the message"),
        ({"$unknown": 1}, b"", "malformed"),
    ],
)
def test_forged_messages_are_refused(tree, payload, match):
    with pytest.raises(WireError, match=match):
        decode(_forge(tree, payload))


def test_deep_or_huge_headers_are_refused():
    """A header nesting deeper than the parser recurses, or a tensor whose shape multiplies past int64,
    is a WireError (never a RecursionError, never an allocation of the claimed size)."""
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(WireError, match="nests deeper"):
        decode(torch.frombuffer(bytearray(len(deep).to_bytes(8, "little") + deep), dtype=torch.uint8))
    tuples = b'{"$tuple":[' * 600 + b"1" + b"]}" * 600
    with pytest.raises(WireError, match="nests deeper"):
        decode(torch.frombuffer(bytearray(len(tuples).to_bytes(8, "little") + tuples), dtype=torch.uint8))
    assert decode(_forge(json.loads(b'{"$tuple":[' * 100 + b"1" + b"]}" * 100))) is not None  # 100 deep: fine
    with pytest.raises(WireError, match="outside the message"):
        decode(_forge({"$tensor": ["uint8", [2**62, 4], 0]}, b"\0" * 8))


def test_truncated_messages_are_refused():
    buf = encode({"a": torch.arange(10)})
    with pytest.raises(WireError, match="shorter than its header length"):
        decode(buf[:5])
    with pytest.raises(WireError, match="header of"):
        decode(buf[:20])
    with pytest.raises(WireError, match="outside the message"):
        decode(buf[:-1])


def test_announced_sizes_are_bounded_before_any_allocation(monkeypatch):
    """A receiver allocates only for a size a message may have: 8 bytes to MAX_MESSAGE_BYTES."""
    from expertcache.parallel import wire

    assert wire.check_size(8) == 8 and wire.check_size(wire.MAX_MESSAGE_BYTES) == wire.MAX_MESSAGE_BYTES
    for n in (-1, 0, 7, wire.MAX_MESSAGE_BYTES + 1, 1 << 62):
        with pytest.raises(WireError, match=f"message of {n} bytes announced"):
            wire.check_size(n)
    monkeypatch.setattr(wire, "MAX_MESSAGE_BYTES", 4096)
    encode(torch.zeros(1000, dtype=torch.uint8))  # under the cap with its header
    with pytest.raises(WireError, match="message of .* bytes announced"):  # the sender refuses too
        encode(torch.zeros(4096, dtype=torch.uint8))
