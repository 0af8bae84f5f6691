"""`avatar serve text MODEL`: one model's text encoder, loaded once, answering encode requests over HTTP.

Why a service: the wan-s2v family's umT5-XXL is 11.4 GB of weights used once per prompt; a fleet of renderers
asks one warm encoder instead of each loading it (and keeps the answers in its text cache).

API (schema avatar-text/1; docs/text-service.md):
- GET /v1/health -> {"schema", "family", "model", "encoder_digest", "tokenizer_digest", "dtype", "weights"}: what a
  client compares with its own model's text-cache key before trusting the service. "dtype" is the key's field: the
  dtype the encoder runs in, with the format of its weights when `--weights` quantizes them ("bfloat16+int8");
  "weights" says the format alone (bf16 | fp8 | int8).
- POST /v1/encode, JSON {"schema": "avatar-text/1", "prompt": str, "negative_prompt": str | null,
  "dtype": str | null} -> 200, application/octet-stream: a text-cache entry (safetensors bytes of the family's
  prompt tensors; metadata: the key's fields and data_sha256). Never a pickle.
  422: malformed JSON, wrong schema, missing or unknown fields, a negative prompt this family does not encode,
  a prompt longer than the family takes; 409: another dtype (or weights format) than the service's; 413: body too
  large;
  401: no or wrong token; 404: any other path.

Security: loopback by default; any other address needs a token (AVATAR_TEXT_TOKEN or --token-file), and then
every request carries `Authorization: Bearer <token>` (compared in constant time). The token travels in clear
over http: beyond a trusted network, put TLS in front (a reverse proxy).
Load: the encoder runs one request at a time on one worker thread; the others wait in its queue, so memory
holds one request's activations, however many clients there are.
"""

import asyncio
import hashlib
import hmac
import ipaddress
import signal
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import torch
import uvicorn
from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from avatar_cli.errors import InputError, RenderError
from avatar_cli.families.registry import ModelSource, check_model, resolve_model
from avatar_cli.prompts.encode import load_prompt_step
from avatar_cli.prompts.entry import EntryKey, entry_bytes
from avatar_cli.prompts.identity import encoder_dtype, encoder_label, encoder_weights, entry_key, identity
from avatar_cli.runtime.device import Runtime, resolve_runtime
from avatar_cli.runtime.quantize import WEIGHT_FORMATS, check_setting
from avatar_cli.service import SCHEMA, TOKEN_ENV

DTYPES = ("auto", "float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
MIN_TOKEN_CHARS = 16  # a shorter token is guessable; `openssl rand -hex 32` makes a good one


class EncodeRequest(BaseModel):
    """POST /v1/encode's body. Unknown fields are refused: a client speaking a newer schema hears so."""

    model_config = ConfigDict(extra="forbid")
    schema_: Literal["avatar-text/1"] = Field(alias="schema")
    prompt: str
    negative_prompt: str | None = None  # None: the family's own (wan-s2v encodes its S2V negative with every prompt)
    dtype: str | None = None  # None: the service's; another is 409 (bf16, fp32 and int8-weight encodings differ)


class PromptTooLong(ValueError):
    pass


class Encoder:
    """The model's prompt step, loaded once. `encode` runs on one worker thread: requests queue for it."""

    def __init__(self, source: ModelSource, runtime: Runtime, weights: str = "bf16"):
        self.source, self.runtime, self.family = source, runtime, source.family
        self.identity = identity(source)  # (encoder digest, tokenizer digest, negative)
        if self.identity is None:
            raise InputError(f"the {self.family.name} family declares no prompt identity: its encodings cannot be "
                             "served (nothing could tell a job's encoder from another's)")
        self.weights = encoder_weights(self.family, weights)
        if self.weights != weights:
            raise InputError(f"--weights {weights}: the {self.family.name} family does not quantize its text encoder; "
                             "use bf16")
        self.encoder_dtype = encoder_dtype(self.family, runtime.dtype)
        self.dtype = encoder_label(self.encoder_dtype, self.weights)  # the key's field: "bfloat16+int8"
        self.models = load_prompt_step(source, runtime, weights)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="text-encoder")

    @property
    def negative(self) -> str:
        return self.identity[2]

    def key(self, prompt: str) -> EntryKey:
        return entry_key(self.family, self.identity, prompt, self.encoder_dtype, self.weights)

    def health(self) -> dict[str, str]:
        return {"schema": SCHEMA, "family": self.family.name, "model": self.source.name,
                "encoder_digest": self.identity[0], "tokenizer_digest": self.identity[1], "dtype": self.dtype,
                "weights": self.weights}

    def encode(self, prompt: str) -> bytes:
        """The entry's bytes; PromptTooLong for a prompt the family would cut."""
        over = self.family.prompt_overflow(prompt)
        if over is not None:
            n, limit = over
            raise PromptTooLong(f"prompt: {n} tokens; the {self.family.name} family takes at most {limit}")
        with torch.no_grad():  # as the render's prompt step (pipeline/run.py)
            out = self.family.prompt(self.models, prompt, self.runtime.device, self.runtime.dtype)
            return entry_bytes(self.key(prompt), self.family.prompt_tensors(out), str(self.runtime.device))


class Guard:
    """ASGI middleware run before FastAPI parses anything: the bearer token (when one is set), then the body's
    size, by its Content-Length and by the bytes that actually arrive (a chunked body has no length)."""

    def __init__(self, app: Any, token: str | None, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes
        self.expected = hashlib.sha256(f"Bearer {token}".encode()).digest() if token else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])  # ASGI header names are lower case
        if self.expected is not None:
            # Digests of equal length, compared in constant time: neither the token nor its length leaks.
            given = hashlib.sha256(headers.get(b"authorization", b"")).digest()
            if not hmac.compare_digest(given, self.expected):
                return await _answer(scope, receive, send, 401, "missing or wrong token: send "
                                     "'Authorization: Bearer <token>'", {"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length")
        if length is not None and not length.isdigit():
            return await _answer(scope, receive, send, 400, "Content-Length is not a number")
        too_large = f"request body over {self.max_bytes} bytes (--max-request-bytes)"
        if length is not None and int(length) > self.max_bytes:
            return await _answer(scope, receive, send, 413, too_large)
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                return await _answer(scope, receive, send, 413, too_large)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)


async def _answer(scope: dict, receive: Any, send: Any, status: int, detail: str,
                  headers: dict[str, str] | None = None) -> None:
    await JSONResponse({"detail": detail}, status_code=status, headers=headers)(scope, receive, send)


def make_app(encoder: Encoder, token: str | None, max_request_bytes: int) -> FastAPI:
    # No /docs pages (they load scripts from a CDN); the schema is in docs/text-service.md and at /openapi.json.
    app = FastAPI(title="avatar text encoder", version=SCHEMA, docs_url=None, redoc_url=None)

    @app.get("/v1/health")
    async def health() -> dict[str, str]:
        return encoder.health()

    @app.post("/v1/encode", response_class=Response,
              responses={200: {"content": {"application/octet-stream": {}},
                               "description": "safetensors bytes of the prompt tensors"}})
    async def encode(request: EncodeRequest) -> Response:
        if request.dtype is not None and request.dtype != encoder.dtype:
            raise HTTPException(409, f"dtype: this service encodes in {encoder.dtype}, the request asks for "
                                     f"{request.dtype}")
        if request.negative_prompt is not None and request.negative_prompt != encoder.negative:
            what = f"its own negative prompt {encoder.negative[:40]!r}..." if encoder.negative else "no negative prompt"
            raise HTTPException(422, f"negative_prompt: the {encoder.family.name} family encodes {what}; "
                                     "leave the field out")
        try:
            blob = await asyncio.get_running_loop().run_in_executor(encoder.worker, encoder.encode, request.prompt)
        except PromptTooLong as e:
            raise HTTPException(422, str(e)) from None
        return Response(blob, media_type="application/octet-stream")

    app.add_middleware(Guard, token=token, max_bytes=max_request_bytes)
    return app


# --- running it -------------------------------------------------------------------------------------------------

def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def resolve_token(token_file: Path | None, env: dict[str, str]) -> str | None:
    """--token-file's content (stripped), else $AVATAR_TEXT_TOKEN, else None."""
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as e:
            raise InputError(f"--token-file: cannot read {token_file} ({e.strerror})") from None
        if not token:
            raise InputError(f"--token-file: {token_file} is empty")
    else:
        token = env.get(TOKEN_ENV, "").strip() or None
    if token is not None and (len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token)):
        raise InputError(f"token: at least {MIN_TOKEN_CHARS} characters without spaces (e.g. `openssl rand -hex 32`)")
    return token


def listen(host: str, port: int) -> socket.socket:
    """The bound socket (port 0: a free one), before any model loads: a busy port is exit 2 at once."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        raise InputError(f"--host/--port: cannot listen on {host}:{port} ({e.strerror or e})") from None
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class Running:
    """A uvicorn server on an open socket, in a thread of this process: `url`, `stop()`."""

    def __init__(self, app: FastAPI, sock: socket.socket, log_level: str = "info", quiet: bool = False):
        # quiet: no access log and leave the process's logging setup alone (tests and benches in-process)
        config = uvicorn.Config(app, log_level=log_level, access_log=not quiet, lifespan="off",
                                **({"log_config": None} if quiet else {}))
        self.server = uvicorn.Server(config)
        self.url = url_of(sock)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True,
                                       name="text-service")

    def start(self, wait_s: float = 30.0) -> "Running":
        self.thread.start()
        step = 0.01
        for _ in range(int(wait_s / step)):
            if self.server.started or not self.thread.is_alive():
                break
            self.thread.join(step)
        if not self.server.started:
            raise RenderError(f"text service at {self.url} did not start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def serve(model: str, host: str, port: int, dtype: str, device: str, threads: int, max_request_bytes: int,
          token_file: Path | None, say: Any, env: dict[str, str], weights: str = "bf16") -> None:
    """`avatar serve text`: check the settings and the port, load the encoder once, serve until SIGINT/SIGTERM
    (then finish the requests under way and exit 0)."""
    if dtype not in DTYPES:
        raise InputError(f"--dtype: {dtype!r}: choose from {', '.join(DTYPES)}")
    if device not in DEVICES:
        raise InputError(f"--device: {device!r}: choose from {', '.join(DEVICES)}")
    if weights not in WEIGHT_FORMATS:
        raise InputError(f"--weights: {weights!r}: choose from {', '.join(WEIGHT_FORMATS)}")
    if threads < 0:
        raise InputError(f"--threads: {threads} must not be negative (0: torch's default)")
    if max_request_bytes < 1024:
        raise InputError(f"--max-request-bytes: {max_request_bytes} is too small for a request (at least 1024)")
    token = resolve_token(token_file, env)
    if token is None and not is_loopback(host):
        raise InputError(f"--host {host}: serving beyond loopback needs a token: set {TOKEN_ENV} or pass "
                         "--token-file")
    sock = listen(host, port)
    source = resolve_model(model, Path.cwd())
    check_model(source)
    if weights != "bf16":
        try:  # torchao installed, the family quantizes something (the Encoder checks that it is the text encoder)
            check_setting(weights, source.family.name, source.family.parallel.quantized)
        except ValueError as e:
            raise InputError(f"--weights: {e}") from None
    encoder = Encoder(source, resolve_runtime(device, dtype, threads), weights)
    running = Running(make_app(encoder, token, max_request_bytes), sock).start()
    say(f"serving {source.name} ({encoder.family.name}, {encoder.dtype}, weights {encoder.weights}, "
        f"{encoder.runtime.device}) text encodings "
        f"at {running.url}/v1/ ({'token required' if token else 'no token'}); Ctrl-C stops")

    def stop(signum: int, frame: Any) -> None:  # noqa: ARG001
        running.server.should_exit = True

    # The server runs in a thread and the main thread waits for it: a signal asks it to stop gracefully
    # (uvicorn's own handlers would re-raise the signal after the shutdown, and a stopped service is no failure).
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    while running.thread.is_alive():
        running.thread.join(0.5)
    encoder.worker.shutdown(wait=True)
    say("text service stopped")
