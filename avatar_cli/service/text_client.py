"""The client of `avatar serve text`: what a render asks when its text cache lacks a prompt.

Nothing it receives is trusted: the health must name this job's encoder, tokenizer and dtype, and an encoding
must be a text-cache entry for exactly this job's key (prompts/entry.verify: the key's fields and the
data digest in its safetensors metadata). Anything else is garbage, said with the URL.

Retries: connection errors, timeouts and 5xx answers are tried again, `retries` more times, after 0.25 s,
0.5 s, 1 s, ... (a service restarting or a load balancer between replicas); a 4xx is the same answer next time,
so it is not retried.
"""

import os
import time
from collections.abc import Callable
from typing import Any

import httpx
import torch

from avatar_cli.errors import InputError
from avatar_cli.prompts.entry import EntryKey, metadata, verify
from avatar_cli.service import SCHEMA, TOKEN_ENV

BACKOFF_S = 0.25  # the first retry's wait; each further one waits twice as long


class ServiceError(Exception):
    """The service is down, refused the request, or answered garbage; the message names its URL."""


class TextServiceClient:
    """One service: `check(key)` (its health against the job's key), `encode(key)` (an encoding, verified).
    token: the bearer token (default: $AVATAR_TEXT_TOKEN). transport: httpx's, for tests."""

    def __init__(self, url: str, timeout_s: float = 30.0, retries: int = 2, token: str | None = None,
                 transport: httpx.BaseTransport | None = None, sleep: Callable[[float], None] = time.sleep):
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, TypeError) as e:
            raise InputError(f"runtime.text_service.url: {url!r} is not a URL ({e})") from None
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise InputError(f"runtime.text_service.url: {url!r}: give http://HOST:PORT (or https://) of "
                             "`avatar serve text`")
        if not timeout_s > 0:
            raise InputError(f"runtime.text_service.timeout_s: {timeout_s} must be positive")
        if retries < 0:
            raise InputError(f"runtime.text_service.retries: {retries} must not be negative")
        self.url = url.rstrip("/")
        self.timeout_s, self.retries, self.sleep = timeout_s, retries, sleep
        token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.url, timeout=timeout_s, headers=headers, transport=transport)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "TextServiceClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def error(self, what: str) -> ServiceError:
        return ServiceError(f"text service {self.url}: {what}")

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """The answer (200), after at most 1 + retries attempts; ServiceError otherwise."""
        why = ""
        for attempt in range(self.retries + 1):
            if attempt:
                self.sleep(BACKOFF_S * 2 ** (attempt - 1))
            try:
                r = self.http.request(method, path, **kwargs)
            except httpx.TimeoutException:
                why = f"no answer within {self.timeout_s:g} s"
                continue
            except httpx.TransportError as e:
                why = f"cannot connect ({str(e) or type(e).__name__})"
                continue
            if r.status_code >= 500:
                why = f"answered HTTP {r.status_code}{_detail(r)}"
                continue
            if r.status_code >= 400:
                raise self.error(f"refused the request: HTTP {r.status_code}{_detail(r)}")
            if r.status_code != 200:
                raise self.error(f"answered HTTP {r.status_code}, not 200: not an avatar text service")
            return r
        n = self.retries + 1
        raise self.error(f"{why} ({n} attempt{'s' if n > 1 else ''})")

    def health(self) -> dict[str, Any]:
        r = self.request("GET", "/v1/health")
        try:
            body = r.json()
        except ValueError:
            raise self.error("answered /v1/health with something other than JSON: not an avatar text service") from None
        if not isinstance(body, dict) or body.get("schema") != SCHEMA:
            got = body.get("schema") if isinstance(body, dict) else type(body).__name__
            raise self.error(f"answered /v1/health with schema {got!r}, not {SCHEMA!r}")
        return body

    def check(self, key: EntryKey) -> None:
        """The service encodes with this key's family, encoder weights, tokenizer and dtype (its `dtype` field: the
        dtype, and the weights format of a quantized encoder), ServiceError naming what differs if not."""
        h = self.health()
        wanted = {"family": key.family, "encoder_digest": key.encoder, "tokenizer_digest": key.tokenizer,
                  "dtype": key.dtype}
        differ = [name for name, v in wanted.items() if h.get(name) != v]
        wrong = [f"{name} {_short(h.get(name))} (this job: {_short(wanted[name])})" for name in differ]
        if differ == ["dtype"]:  # the same encoder run otherwise: in another dtype, or with other weights
            raise self.error(f"serves this model's encoder in another dtype or weights format (the job's "
                             f"runtime.dtype and runtime.weights against `avatar serve text --dtype/--weights`): its "
                             + wrong[0])
        if wrong:
            raise self.error(f"serves another model ({h.get('model')}): its " + ", ".join(wrong))

    def encode(self, key: EntryKey) -> tuple[dict[str, torch.Tensor], str]:
        """(the family's prompt tensors for this key, the device the service encoded on)."""
        body = {"schema": SCHEMA, "prompt": key.prompt, "negative_prompt": key.negative or None, "dtype": key.dtype}
        r = self.request("POST", "/v1/encode", json=body)
        tensors, problem = verify(r.content, key)
        if problem is not None:
            raise self.error(f"answered /v1/encode with garbage: {problem}")
        return tensors, str(metadata(r.content).get("device", "unknown"))


def _short(value: Any) -> str:
    """A digest's first 12 characters are enough to tell two apart in a message."""
    text = str(value)
    return repr(text[:12] + "…") if len(text) > 16 else repr(text)


def _detail(r: httpx.Response) -> str:
    """FastAPI's `detail` (a message, or the first validation error), as ': ...'."""
    try:
        detail = r.json().get("detail")
    except (ValueError, AttributeError):
        return ""
    if isinstance(detail, list) and detail and isinstance(detail[0], dict):
        where = ".".join(str(p) for p in detail[0].get("loc", ()) if p != "body")
        detail = f"{where}: {detail[0].get('msg', '')}" if where else detail[0].get("msg", "")
    return f" ({str(detail)[:200]})" if detail else ""
