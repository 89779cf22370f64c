"""Send events at or above a severity to Apprise URLs (Slack, Feishu, email, webhooks...).

Delivery runs on a background thread: a slow or failing notifier is logged and never blocks or
breaks the job.
"""

from __future__ import annotations

import logging
import os
import queue
import threading

from trainguard.events.model import Event, Severity

log = logging.getLogger(__name__)

ENV_URLS = "TRAINGUARD_NOTIFY"


def urls_from_env() -> list[str]:
    raw = os.environ.get(ENV_URLS, "")
    return [u for u in (part.strip() for part in raw.replace(",", " ").split()) if u]


def bad_urls(urls: list[str]) -> list[str]:
    """The URLs Apprise does not understand (scheme unknown, malformed), redacted for printing."""
    if not urls:
        return []
    import apprise

    client = apprise.Apprise()
    return [_redact(u) for u in urls if not client.add(u)]


class Notifier:
    def __init__(self, urls: list[str], min_severity: Severity = Severity.ERROR, job: str = "") -> None:
        self.urls = list(urls)
        self.min_severity = min_severity
        self.job = job
        self.failures = 0
        self.sent = 0
        self._q: queue.Queue[Event | None] = queue.Queue(maxsize=1000)
        self._thread: threading.Thread | None = None
        self._apprise = None
        if self.urls:
            self._thread = threading.Thread(target=self._run, name="trainguard-notify", daemon=True)
            self._thread.start()

    def __call__(self, event: Event) -> None:
        if not self.urls or event.severity < self.min_severity:
            return
        try:
            self._q.put_nowait(event)
        except queue.Full:
            log.warning("notification queue full; dropping %s event", event.kind)

    def _client(self):
        if self._apprise is None:
            import apprise

            client = apprise.Apprise()
            for url in self.urls:
                if not client.add(url):
                    log.warning("notifier: apprise does not understand URL %s", _redact(url))
            self._apprise = client
        return self._apprise

    def _run(self) -> None:
        while True:
            event = self._q.get()
            if event is None:
                return
            try:
                title = f"[trainguard] {event.severity.label.upper()} {event.kind}" + (f" ({self.job})" if self.job else "")
                where = f"node={event.node}" + (f" rank={event.rank}" if event.rank is not None else "")
                ok = self._client().notify(title=title, body=f"{event.message}\n{where}")
                if ok:
                    self.sent += 1
                else:
                    self.failures += 1
                    log.warning("notifier: delivery of %s failed", event.kind)
            except Exception as exc:  # a notifier must never break the job
                self.failures += 1
                log.warning("notifier: delivery of %s raised %s", event.kind, exc)
            finally:
                self._q.task_done()

    def flush(self, timeout: float = 10.0) -> None:
        """Wait (bounded) until queued notifications were attempted."""
        if self._thread is None:
            return
        done = threading.Event()

        def waiter() -> None:
            self._q.join()
            done.set()

        threading.Thread(target=waiter, daemon=True).start()
        done.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        self.flush(timeout)
        try:
            self._q.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout=1.0)
        self._thread = None


def _redact(url: str) -> str:
    scheme, _, _ = url.partition("://")
    return f"{scheme}://…"
