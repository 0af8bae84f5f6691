"""`avatar serve text` and its client: the service's encodings are the local ones bit for bit, a
render naming it loads no text encoder and makes the same video, a service that is down is exit 2 at validation
and exit 1 during a render (or a fallback with a note), bad requests get a 4xx while the service keeps serving,
and 8 clients' load leaves its memory flat."""

import json
import re
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch
from typer.testing import CliRunner

from avatar_cli import render as rendering

from avatar_cli.job import resolve

from avatar_cli.cli import app
from avatar_cli.errors import InputError, RenderError
from avatar_cli.families.registry import resolve_model
from avatar_cli.prompts.cache import PromptCache
from avatar_cli.prompts.encode import load_prompt_step
from avatar_cli.prompts.entry import entry_bytes
from avatar_cli.prompts.store import TextCache
from avatar_cli.report import QuietReporter
from avatar_cli.runtime.device import resolve_runtime
from avatar_cli.service import SCHEMA, TOKEN_ENV
from avatar_cli.service.text_client import BACKOFF_S, ServiceError, TextServiceClient
from avatar_cli.service.text_server import Encoder, Running, listen, make_app
from avatar_cli.spec import load_job
from bench.loadtest import run_load, start_server
from tests.conftest import write_reference, write_wav

TOKEN = "0123456789abcdef-test-token"
CPU32 = resolve_runtime("cpu", "float32")


class Notes(QuietReporter):
    def __init__(self):
        super().__init__(0)
        self.notes: list[str] = []

    def info(self, message: str) -> None:
        self.notes.append(message)


def serve(model: Path, token: str | None = None, max_bytes: int = 65536) -> Running:
    encoder = Encoder(resolve_model(str(model), model.parent), CPU32)
    return Running(make_app(encoder, token, max_bytes), listen("127.0.0.1", 0), log_level="warning", quiet=True).start()


@pytest.fixture(scope="module")
def service(tiny_model: Path):
    running = serve(tiny_model)
    yield running
    running.stop()


def key_for(model: Path, folder: Path, prompt: str):
    return PromptCache(TextCache(folder), resolve_model(str(model), model.parent), torch.float32).key(prompt)


@pytest.fixture
def jobs(tmp_path: Path) -> Path:
    write_reference(tmp_path / "ref.png")
    write_wav(tmp_path / "speech.wav", 0.5)
    return tmp_path


def write_job(folder: Path, name: str, model: Path, url: str | None, cache: str = "off", fallback: bool = False,
              retries: int = 1) -> Path:
    service = json.dumps({"url": url, "fallback": fallback, "timeout_s": 5.0, "retries": retries})
    path = folder / f"{name}.yaml"
    path.write_text(f"reference: ref.png\naudio: speech.wav\noutput: out/{name}.mp4\nmodel: {model}\n"
                    f"prompt: smiling calm\nseed: 3\nchunking: {{frames: 16, motion_frames: 3, transition_frames: 4}}\n"
                    f"runtime: {{text_cache: {cache}, dtype: float32, text_service: {service}}}\n")
    return path


def closed_url() -> str:
    sock = listen("127.0.0.1", 0)  # a port just free; nothing listens there once it is closed
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


def test_service_encoding_equals_local_bit_for_bit(service, tiny_model, tmp_path):
    key = key_for(tiny_model, tmp_path, "smiling calm person")
    with TextServiceClient(service.url, retries=0) as client:
        client.check(key)
        tensors, device = client.encode(key)
    source = resolve_model(str(tiny_model), tiny_model.parent)
    with torch.no_grad():
        local = source.family.prompt(load_prompt_step(source, CPU32, "bf16"), key.prompt, CPU32.device, torch.float32)
    assert device == "cpu" and torch.equal(tensors["text"], local) and local.shape[1] == 3  # (1, 3 tokens, D)

    # A job whose model or dtype differs is told the service serves another one, by name.
    bf16 = replace(key, dtype="bfloat16")
    with TextServiceClient(service.url, retries=0) as client, pytest.raises(ServiceError, match="dtype 'float32'"):
        client.check(bf16)


def test_render_through_service_loads_no_text_encoder_and_matches_local(service, tiny_model, jobs):
    local = rendering.render(resolve(load_job(write_job(jobs, "local", tiny_model, None))), Notes())
    cache = rendering.ModelCache()
    remote = rendering.render(resolve(load_job(write_job(jobs, "remote", tiny_model, service.url, "cache"))),
                           Notes(), cache)
    (modules, _), = cache.loaded.values()
    assert "text" not in modules and {"dit", "vae", "sr", "audio"} <= set(modules)
    assert remote["text_cache"] == "service" and local["text_cache"] == "off"
    assert remote["frames_digest"] == local["frames_digest"]
    # What the service answered went into the cache, as a valid entry.
    key = key_for(tiny_model, jobs / "cache", "smiling calm")
    assert TextCache(jobs / "cache").read(key)[1] is None and len(list((jobs / "cache").glob("*.safetensors"))) == 1


def test_service_down_is_exit_2_at_validation_and_1_during_a_render(tiny_model, jobs):
    down = closed_url()
    result = CliRunner().invoke(app, ["validate", str(write_job(jobs, "down", tiny_model, down)), "--no-json"])
    assert result.exit_code == 2 and down in result.output and "cannot connect" in result.output

    # A service of another model (the shipped mini: other weights than the job's) is garbage: exit 2, said so.
    running = serve(Path("mini"))
    try:
        with pytest.raises(InputError, match="serves another model") as garbage:
            resolve(load_job(write_job(jobs, "other", tiny_model, running.url)))
        assert garbage.value.exit_code == 2 and running.url in str(garbage.value)
    finally:
        running.stop()

    # Up at validation, gone when the render asks: exit 1 naming the URL, nothing written at the output.
    running = serve(tiny_model)
    prepared = resolve(load_job(write_job(jobs, "killed", tiny_model, running.url)))
    running.stop()
    with pytest.raises(RenderError) as failed:
        rendering.render(prepared, Notes())
    assert failed.value.exit_code == 1 and running.url in str(failed.value) and "2 attempts" in str(failed.value)
    assert not prepared.job.output.exists()

    # fallback: true: a note, the encoder loaded here, the same video as a local render.
    notes = Notes()
    fell_back = rendering.render(resolve(load_job(write_job(jobs, "fallback", tiny_model, down, fallback=True))),
                              notes)
    said = [n for n in notes.notes if down in n]
    assert len(said) == 1 and "encoding the prompt here instead" in said[0] and fell_back["text_cache"] == "miss"
    local = rendering.render(resolve(load_job(write_job(jobs, "local", tiny_model, None))), Notes())
    assert fell_back["frames_digest"] == local["frames_digest"]


def test_prompts_encode_fills_the_cache_through_the_service(service, tiny_model, jobs, monkeypatch):
    """`avatar prompts encode` asks the jobs' text service, as their renders would: this host loads no text
    encoder, and the entries it writes are the ones a render then hits."""
    from avatar_cli.prompts import encode

    def no_local_encoder(*_):
        raise AssertionError("the text encoder was loaded here")

    job = write_job(jobs, "fill", tiny_model, service.url, "cache")
    with monkeypatch.context() as m:
        m.setattr(encode, "_encode_all", no_local_encoder)
        first = encode.fill([job], [], lambda _: None)
        again = encode.fill([job], [], lambda _: None)
    assert (first.new, first.fetched, first.cached, first.bad) == (1, 1, 0, [])
    assert (again.new, again.fetched, again.cached) == (0, 0, 1)
    key = key_for(tiny_model, jobs / "cache", "smiling calm")
    assert TextCache(jobs / "cache").read(key)[1] is None

    # The service down: the error a render would get, naming the URL; with fallback, encoded here instead.
    down = closed_url()
    with pytest.raises(RenderError, match=down.replace(".", r"\.")):
        encode.fill([write_job(jobs, "down", tiny_model, down, "cache2")], [], lambda _: None)
    fell_back = encode.fill([write_job(jobs, "fb", tiny_model, down, "cache3", fallback=True)], [], lambda _: None)
    assert (fell_back.new, fell_back.fetched) == (1, 0)


def test_bad_requests_get_4xx_and_the_service_keeps_serving(tiny_model, tmp_path, monkeypatch):
    running = serve(tiny_model, token=TOKEN, max_bytes=4096)
    good = {"schema": SCHEMA, "prompt": "smiling"}
    auth = {"Authorization": f"Bearer {TOKEN}"}
    bad = [
        ({"json": good}, 401),  # no token
        ({"json": good, "headers": {"Authorization": "Bearer " + "x" * len(TOKEN)}}, 401),  # wrong token
        ({"content": b'{"schema": "avatar-text/1", "prompt": ', "headers": auth}, 422),  # malformed JSON
        ({"json": {**good, "schema": "avatar-text/0"}, "headers": auth}, 422),  # another schema
        ({"json": {"schema": SCHEMA}, "headers": auth}, 422),  # no prompt
        ({"json": {**good, "prompt": 7}, "headers": auth}, 422),  # not a string
        ({"json": {**good, "temperature": 1}, "headers": auth}, 422),  # unknown field
        ({"json": {**good, "prompt": "smiling " * 17}, "headers": auth}, 422),  # 17 tokens, mini takes 16
        ({"json": {**good, "negative_prompt": "blurry"}, "headers": auth}, 422),  # mini encodes no negative
        ({"json": {**good, "dtype": "bfloat16"}, "headers": auth}, 409),  # the service runs float32
        ({"json": {**good, "prompt": "x" * 5000}, "headers": auth}, 413),  # Content-Length over the limit
        ({"content": iter([b"x" * 3000, b"x" * 3000]), "headers": auth}, 413),  # chunked, no length: counted
    ]
    with httpx.Client(base_url=running.url, timeout=10) as http:
        for kwargs, status in bad:
            r = http.post("/v1/encode", **kwargs)
            assert r.status_code == status, (kwargs, r.text)
            assert http.get("/v1/health", headers=auth).status_code == 200  # still serving
        assert "16" in http.post("/v1/encode", json={**good, "prompt": "smiling " * 17}, headers=auth).text
        assert http.get("/v1/nothing", headers=auth).status_code == 404
        assert http.get("/v1/health").status_code == 401
    key = key_for(tiny_model, tmp_path, "smiling")
    monkeypatch.setenv(TOKEN_ENV, TOKEN)  # what a render's client sends
    with TextServiceClient(running.url, retries=0) as client:
        assert client.encode(key)[0]["text"].shape == (1, 1, 16)
    with TextServiceClient(running.url, token="wrong-token-0123456789", retries=3) as client:
        with pytest.raises(ServiceError, match="HTTP 401"):  # a 4xx is not retried (no backoff wait here)
            client.encode(key)
    running.stop()

    # Beyond loopback without a token, or with a short one: refused at start (exit 2), before any model loads.
    cli = CliRunner()
    refused = cli.invoke(app, ["serve", "text", "mini", "--host", "0.0.0.0"], env={TOKEN_ENV: ""})
    assert refused.exit_code == 2 and "needs a token" in refused.output
    short = cli.invoke(app, ["serve", "text", "mini", "--host", "0.0.0.0"], env={TOKEN_ENV: "abc"})
    assert short.exit_code == 2 and "at least 16 characters" in short.output


def test_client_retries_only_what_may_pass_next_time(tiny_model, tmp_path):
    key = key_for(tiny_model, tmp_path, "smiling")
    entry = entry_bytes(key, {"text": torch.ones(1, 1, 16)}, "cpu")
    answers: list[httpx.Response] = []
    calls: list[str] = []
    waits: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def client(retries: int = 2) -> TextServiceClient:
        calls.clear()
        waits.clear()
        return TextServiceClient("http://svc:1", retries=retries, transport=httpx.MockTransport(handler),
                                 sleep=waits.append)

    answers[:] = [httpx.Response(503), httpx.ConnectError("refused"), httpx.Response(200, content=entry)]
    assert torch.equal(client().encode(key)[0]["text"], torch.ones(1, 1, 16))
    assert len(calls) == 3 and waits == [BACKOFF_S, 2 * BACKOFF_S]  # bounded, exponential

    answers[:] = [httpx.ReadTimeout("slow")] * 3
    with pytest.raises(ServiceError, match=r"no answer within 30 s \(3 attempts\)"):
        client().encode(key)
    answers[:] = [httpx.Response(422, json={"detail": "prompt: 20 tokens; the mini family takes at most 16"})]
    with pytest.raises(ServiceError, match="HTTP 422 .*at most 16"):
        client().encode(key)
    assert len(calls) == 1

    # Garbage: not safetensors, a flipped byte (its data digest), another prompt's entry, a health of another kind.
    other = entry_bytes(replace(key, prompt="calm"), {"text": torch.ones(1, 1, 16)}, "cpu")
    flipped = entry[:-1] + bytes([entry[-1] ^ 1])
    for body, why in [(b"<html>", "shorter than|safetensors"), (flipped, "digest"), (other, "prompt differ")]:
        answers[:] = [httpx.Response(200, content=body)]
        with pytest.raises(ServiceError, match=f"garbage: .*({why})"):
            client().encode(key)
    answers[:] = [httpx.Response(200, json={"status": "ok"})]
    with pytest.raises(ServiceError, match="schema None"):
        client().check(key)


def test_load_8_clients_no_failure_memory_flat(tmp_path):
    """The shipped mini in its own process; 8 threads, 200 requests (bench/text_service.py runs 1,000)."""
    server = start_server("mini", "--dtype", "float32", "--threads", "1")
    try:
        key = PromptCache(TextCache(tmp_path), resolve_model("mini", tmp_path), torch.float32).key
        result = run_load(server.url, key, server.process.pid, total=200, warmup=100)
    finally:
        code = server.stop()
    assert result.failures == [] and len(result.latencies_s) == 200
    assert result.rss_end_mb < 1.05 * result.rss_warm_mb, (result.rss_warm_mb, result.rss_end_mb)
    assert code == 0 and any("text service stopped" in line for line in server.lines)  # SIGTERM: a clean stop


def test_without_the_extra_a_named_service_says_how_to_install_it(monkeypatch, tiny_model, jobs):
    import sys

    for name in ("httpx", "fastapi"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed: importing it raises ImportError
    for name in ("avatar_cli.service.text_client", "avatar_cli.service.text_server"):
        monkeypatch.delitem(sys.modules, name)  # imported afresh, so they meet the missing packages
    with pytest.raises(InputError, match=r"needs httpx.*pip install 'avatar-cli\[service\]'"):
        resolve(load_job(write_job(jobs, "named", tiny_model, "http://127.0.0.1:9")))
    resolve(load_job(write_job(jobs, "unnamed", tiny_model, None)))  # no service named: nothing needed
    served = CliRunner().invoke(app, ["serve", "text", "mini"])
    assert served.exit_code == 2 and "pip install 'avatar-cli[service]'" in served.output


# --- runtime.weights: a quantized umT5 serves other entries --------------------------------------------------------

def write_wan_job(folder: Path, name: str, model: Path, url: str, weights: str, fallback: bool = False) -> Path:
    service = json.dumps({"url": url, "fallback": fallback, "timeout_s": 5.0, "retries": 0})
    path = folder / f"{name}.yaml"
    path.write_text(f"reference: ref.png\naudio: speech.wav\noutput: out/{name}.mp4\nmodel: {model}\n"
                    "prompt: a person talking\nseed: 3\nvideo: {width: 64, height: 64}\nsampling: {steps: 4}\n"
                    f"runtime: {{text_cache: cache, dtype: float32, weights: {weights}, text_service: {service}}}\n")
    return path


def test_a_service_with_quantized_weights_serves_only_jobs_with_those_weights(jobs):
    """`avatar serve text --weights int8` (wan-s2v: umT5's Linears in int8) says so in its health and keys; a bf16
    job naming it is told at validation (exit 2, both dtypes named), refused during a render (409: exit 1, or with
    fallback the prompt is encoded here, with a note); an int8 job gets the int8 encoder's encodings bit for bit."""
    from avatar_cli.families.registry import init_family_dir

    wan = jobs / "wan"
    init_family_dir(wan, "tiny", family="wan-s2v")
    source = resolve_model(str(wan), jobs)
    running = Running(make_app(Encoder(source, CPU32, "int8"), None, 65536), listen("127.0.0.1", 0),
                      log_level="warning", quiet=True).start()
    try:
        keys = {w: PromptCache(TextCache(jobs / "c"), source, torch.float32, weights=w).key("a person talking")
                for w in ("bf16", "int8", "fp8")}
        with TextServiceClient(running.url, retries=0) as client:
            health = client.health()
            assert (health["dtype"], health["weights"]) == ("float32+int8", "int8")
            client.check(keys["int8"])
            tensors, _ = client.encode(keys["int8"])
            for w in ("bf16", "fp8"):
                with pytest.raises(ServiceError, match="another dtype or weights format.*" + re.escape(
                        f"dtype 'float32+int8' (this job: '{keys[w].dtype}')")):
                    client.check(keys[w])
                with pytest.raises(ServiceError, match=r"HTTP 409.*float32\+int8.*asks for"):
                    client.encode(keys[w])
        with torch.no_grad():
            local = source.family.prompt(load_prompt_step(source, CPU32, "int8"), "a person talking", CPU32.device,
                                         torch.float32)
        assert tensors.keys() == local.keys() and all(torch.equal(tensors[k], local[k]) for k in local)

        # Validation (job.resolve): the bf16 job is exit 2, naming the URL and both; the int8 job passes.
        with pytest.raises(InputError, match=r"float32\+int8.*this job: 'float32'") as refused:
            resolve(load_job(write_wan_job(jobs, "bf16", wan, running.url, "bf16")))
        assert refused.value.exit_code == 2 and running.url in str(refused.value)
        resolve(load_job(write_wan_job(jobs, "int8", wan, running.url, "int8")))

        # During a render (the prompt step's read): the 409 is the render's failure, or with fallback a note.
        service = load_job(write_wan_job(jobs, "late", wan, running.url, "bf16")).spec.runtime.text_service
        with pytest.raises(RenderError, match="HTTP 409"):
            PromptCache(None, source, torch.float32, service=service, weights="bf16").read("a person talking")
        notes: list[str] = []
        fallback = replace(service, fallback=True)
        assert PromptCache(None, source, torch.float32, notes.append, service=fallback,
                           weights="bf16").read("a person talking") is None
        assert len(notes) == 1 and "HTTP 409" in notes[0] and "encoding the prompt here instead" in notes[0]
    finally:
        running.stop()


def test_serve_text_weights_must_fit_the_family():
    with pytest.raises(InputError, match="mini family does not quantize its text encoder"):
        Encoder(resolve_model("mini", Path.cwd()), CPU32, "int8")
    bad = CliRunner().invoke(app, ["serve", "text", "mini", "--weights", "int4"])
    assert bad.exit_code == 2 and "--weights: 'int4'" in bad.output
