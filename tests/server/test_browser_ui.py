"""The browser UI at / of `expertcache serve`, driven in a real headless Chromium (Debian's chromium +
chromedriver through selenium; no browser download): the page loads, a message streams a reply that
equals the API's own answer, the layer x expert heatmap updates after a generation, and a server
with --api-key refuses the chat until the key is entered."""

from __future__ import annotations

import os
import shutil
import time

import httpx
import pytest
from serving import start_server

webdriver = pytest.importorskip("selenium.webdriver")
CHROMIUM, DRIVER = (
    shutil.which("chromium") or "/usr/bin/chromium",
    shutil.which("chromedriver") or "/usr/bin/chromedriver",
)
pytestmark = pytest.mark.skipif(
    not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)),
    reason="needs Debian's chromium and chromium-driver (.ci/run installs them)",
)
KEY = "ui-key-42"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
    "--window-size=1280,900",
]


@pytest.fixture(scope="module")
def server(cache_checkpoint, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("ui") / "server.log"
    with start_server(
        cache_checkpoint, log_path, "--api-key", KEY, "--device-memory", "50%", key=KEY, timeout_s=120
    ) as srv:
        yield srv.url


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for f in FLAGS:
        opts.add_argument(f)
    drv = webdriver.Chrome(service=Service(DRIVER), options=opts)
    drv.set_script_timeout(60)
    yield drv
    drv.quit()


def wait_for(drv, js: str, timeout: float = 90.0):
    """Poll a JS expression until it is truthy; returns its value."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = drv.execute_script("return " + js)
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {js}; page: {drv.find_element('id', 'messages').text!r}")


def send(drv, text: str) -> None:
    box = drv.find_element("id", "prompt")
    box.clear()
    box.send_keys(text)
    drv.find_element("id", "send").click()


def test_page_chat_heatmap_and_api_key(server, browser):
    drv = browser
    drv.get(server + "/")
    assert drv.title == "expertcache"
    wait_for(drv, "document.getElementById('status').textContent === 'ready'")
    page = httpx.get(server + "/").text
    assert 'src="ui/app.js"' in page and "://" not in page  # the package's own files, nothing from elsewhere
    assert httpx.get(server + "/ui/app.js").status_code == 200
    # no key yet: the server refuses and the page says why
    send(drv, "hello")
    err = wait_for(drv, "(document.querySelector('.msg.error') || {}).textContent")
    assert "API key" in err
    assert wait_for(drv, "document.getElementById('model').textContent").startswith(
        "missing or invalid API key"
    )

    # with the key: greedy reply streamed, equal to the API's non-streamed answer
    key = drv.find_element("id", "api-key")
    key.send_keys(KEY)
    drv.execute_script("document.getElementById('api-key').dispatchEvent(new Event('change'))")
    drv.execute_script(
        "document.getElementById('temperature').value = '0'; document.getElementById('max-tokens').value = '12'"
    )
    drv.execute_script("document.getElementById('system').value = 'Be brief.'")
    before = int(
        wait_for(drv, "document.getElementById('heatmap').dataset.draws")
        and drv.execute_script("return Number(document.getElementById('heatmap').dataset.totalUses || 0)")
    )
    pixels_before = drv.execute_script("return document.getElementById('heatmap').toDataURL()")
    send(drv, "Tell me about caches")
    wait_for(
        drv,
        "document.querySelector('.msg.assistant') && document.querySelector('.msg.assistant').dataset.done",
    )
    got = drv.execute_script("return document.querySelector('.msg.assistant').textContent")
    ref = httpx.post(
        server + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
        json={
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Tell me about caches"},
            ],
            "temperature": 0,
            "max_tokens": 12,
        },
    ).json()
    assert got == ref["choices"][0]["message"]["content"]
    assert drv.execute_script("return window.expertcacheUI.lastChunks") > 1  # arrived in pieces (SSE)
    assert "tok/s" in drv.find_element("id", "speed").text

    # the heatmap redraws with more uses after the generation, and the tier table has numbers
    wait_for(drv, f"Number(document.getElementById('heatmap').dataset.totalUses) > {before}")
    assert drv.execute_script("return document.getElementById('heatmap').toDataURL()") != pixels_before
    rows = drv.find_element("id", "tiers").text
    assert "device" in rows and "%" in rows
    stats = httpx.get(server + "/stats", headers={"Authorization": f"Bearer {KEY}"}).json()["expert_stats"]
    assert {tuple(r) for r in stats["residency"]} and all(set(r) <= {0, 1, 2} for r in stats["residency"])
    dev_slots = stats["per_tier"]["device"]["slots_per_layer"]
    assert all(r.count(2) <= dev_slots for r in stats["residency"])  # never more on the device than its slots
    assert "bytes moved" in drv.find_element("id", "totals").text
