"""Loads the model in a background thread while the HTTP server already answers /health.

Progress is the share of checkpoint bytes the loader has read, reported by
`LLM(progress=callback)` as (bytes_read, bytes_total).

State moves one way: "loading" -> "ok" | "error". `llm` is set before `state` turns "ok".
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("expertcache.server")


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

    def _on_bytes(self, read: int, total: int) -> None:
        self.read_bytes, self.total_bytes = read, total
        self.maybe_log()

    def maybe_log(self) -> None:
        decile = int(self.progress * 10)
        if decile != self._last_logged:
            self._last_logged = decile
            log.info("loading weights: %d%%", decile * 10)

    def _run(self) -> None:
        from .. import llm as llm_module
        from ..cli_common import error_line

        try:
            llm = llm_module.LLM(**{**self.llm_kwargs, "progress": self._on_bytes})
        except BaseException as e:  # noqa: BLE001 - any failure is reported through /health
            self.error = error_line(e)
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
