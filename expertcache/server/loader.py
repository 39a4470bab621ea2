"""Loads the model in a background thread while the HTTP server already answers /health.

Progress is the share of checkpoint bytes the loader has read. LLM reports them to a tqdm
bar it creates in expertcache.llm; while loading, that module's `tqdm` name is pointed at a
tqdm subclass that keeps the count instead of drawing a bar. Nothing else in this
process uses expertcache.llm.tqdm during loading (the engine thread starts afterwards).
A dedicated `LLM(progress=callback)` hook would make the patch unnecessary.

State moves one way: "loading" -> "ok" | "error". `llm` is set before `state` turns "ok".
"""

from __future__ import annotations

import logging
import threading
import time
from unittest import mock

from tqdm import tqdm

log = logging.getLogger("expertcache.server")


def _counting_bar(loader: "ModelLoader") -> type:
    """A tqdm subclass that never draws (a server log is no terminal) and adds the bytes it is
    told about to `loader`; everything else (write, set_postfix, context manager) stays tqdm's."""

    class CountingBar(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            if kwargs.get("unit") == "B":  # the weight-loading bar, not e.g. a generate() bar
                loader.total_bytes = int(kwargs.get("total") or 0)
                self._counts = True
            else:
                self._counts = False

        def update(self, n=1):
            if self._counts:
                loader.read_bytes += int(n)
                loader.maybe_log()
            return super().update(n)

    return CountingBar


class ModelLoader:
    def __init__(self, llm_kwargs: dict, on_done=None):
        self.llm_kwargs = llm_kwargs
        self.on_done = on_done  # called in the loader thread with (llm or None, error or None)
        self.state = "loading"
        self.error: str | None = None
        self.llm = None
        self.total_bytes = 0
        self.read_bytes = 0
        self._last_logged = -1
        self.started = time.monotonic()
        self.thread = threading.Thread(target=self._run, name="model-loader", daemon=True)

    @property
    def progress(self) -> float:
        if self.state == "ok":
            return 1.0
        return min(1.0, self.read_bytes / self.total_bytes) if self.total_bytes else 0.0

    def start(self) -> None:
        self.thread.start()

    def maybe_log(self) -> None:
        decile = int(self.progress * 10)
        if decile != self._last_logged:
            self._last_logged = decile
            log.info("loading weights: %d%%", decile * 10)

    def _run(self) -> None:
        from .. import llm as llm_module

        try:
            with mock.patch.object(llm_module, "tqdm", _counting_bar(self)):
                llm = llm_module.LLM(**self.llm_kwargs)
        except BaseException as e:  # noqa: BLE001 - any failure is reported through /health
            self.error = f"{type(e).__name__}: {e}"
            self.state = "error"
            log.error("model failed to load: %s", self.error)
            if self.on_done:
                self.on_done(None, self.error)
            return
        self.llm = llm
        for line in llm.plan_lines:
            log.info("%s", line)
        log.info("model loaded in %.1f s", time.monotonic() - self.started)
        if self.on_done:
            self.on_done(llm, None)
        self.state = "ok"
