"""Job spec: defaults, overrides, path resolution, and errors that name the key."""

from pathlib import Path

import pytest

from avatar_cli.errors import SpecError
from avatar_cli.spec import load_job


def write_job(folder: Path, text: str) -> Path:
    path = folder / "job.yaml"
    path.write_text(text)
    return path


BASE = "reference: ref.png\naudio: a.wav\noutput: out.mp4\n"


def test_relative_paths_resolve_against_job_folder(tmp_path, monkeypatch):
    sub = tmp_path / "jobs"
    sub.mkdir()
    monkeypatch.chdir(tmp_path)
    job = load_job(write_job(sub, BASE))
    assert job.reference == sub / "ref.png"
    assert job.audio == sub / "a.wav"
    assert job.output == sub / "out.mp4"
    assert job.partial_output == sub / "out.partial.mp4"


def test_overrides_and_output_flag(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = load_job(write_job(tmp_path, BASE), ["video.fps=30", "seed=7", "chunking.transitions=false",
                                               "prompt=smiling person"], output="elsewhere/x.mp4")
    s = job.spec
    assert (s.video.fps, s.seed, s.chunking.transitions, s.prompt) == (30.0, 7, False, "smiling person")
    assert job.output == tmp_path / "elsewhere" / "x.mp4"
    assert s.sampling.steps == 4  # untouched defaults stay


@pytest.mark.parametrize("text,overrides,needle", [
    (BASE + "colour: red\n", [], "unknown key 'colour'"),
    (BASE + "video:\n  fpss: 30\n", [], "unknown key 'video.fpss'"),
    (BASE, ["video.fps=fast"], "video.fps"),
    (BASE, ["chunking.frames=1.5"], "chunking.frames"),
    (BASE, ["runtime.device=tpu"], "'runtime.device': 'tpu', expected one of auto, cpu, cuda"),
    (BASE, ["video.codec=vp9"], "'video.codec': 'vp9', expected one of auto, libx264, h264_nvenc"),
    (BASE + "runtime:\n  dtype: int8\n", [],
     "'runtime.dtype': 'int8', expected one of auto, float32, bfloat16, float16"),
    (BASE, ["video.preset=ultrafastest"], "video.preset must be one of ultrafast, superfast,"),
    (BASE, ["video.preset=p4"], "video.preset must be one of"),
    (BASE, ["video.width=8194", "video.height=256"], "video.width must be at most 8192"),
    (BASE, ["output=out/${nope}.mp4"], "cannot resolve 'output': Interpolation key 'nope' not found"),
    (BASE, ["seed=${video.nope}"], "cannot resolve 'seed': Interpolation key 'video.nope' not found"),
    ("reference: ref.png\naudio: a.wav\noutput: out/${seed.mp4\n", [], "cannot resolve 'output'"),
    (BASE, ["nope.key=1"], "unknown key 'nope'"),
    ("reference: ref.png\naudio: a.wav\n", [], "missing required key 'output'"),
    (BASE, ["video.fps=0"], "video.fps must be positive"),
    (BASE, ["video.fps=-25"], "video.fps must be positive"),
    (BASE, ["chunking.frames=0"], "chunking.frames must be positive"),
    (BASE, ["chunking.motion_frames=24"], "motion_frames must be smaller"),
    (BASE, ["chunking.transition_frames=0"], "transition_frames must be positive"),
    (BASE, ["chunking.transitions=maybe"], "chunking.transitions must be true, false or auto"),
    (BASE, ["chunking.motion_frames=10", "chunking.transition_frames=20"], "must not exceed chunking.frames"),
    (BASE, ["video.width=255", "video.height=256"], "video.width"),
    (BASE, ["video.width=256"], "set together"),
    (BASE, ["sampling.steps=0"], "sampling.steps"),
    (BASE, ["output=out.mov"], "output must end in .mp4"),
    (BASE, ["live.hls_segment_s=0"], "live.hls_segment_s must be positive"),
    (BASE, ["video.fps"], "expected key=value"),
    ("- a\n- b\n", [], "mapping"),
    ("reference: [unclosed\n", [], "not valid YAML"),
])
def test_bad_specs_name_the_problem(tmp_path, text, overrides, needle):
    with pytest.raises(SpecError) as e:
        load_job(write_job(tmp_path, text), overrides)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_interpolation_sees_overrides_and_paths_stay_relative_to_the_job(tmp_path):
    job = load_job(write_job(tmp_path, BASE.replace("out.mp4", "out/${model}-${seed}.mp4")), ["seed=7"])
    assert job.output == tmp_path / "out" / "mini-7.mp4"


def test_largest_size_and_every_x264_preset_pass(tmp_path):
    for preset in ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow",
                   "placebo"):
        job = load_job(write_job(tmp_path, BASE), ["video.width=8192", "video.height=8192", f"video.preset={preset}"])
        assert (job.spec.video.width, job.spec.video.preset) == (8192, preset)


def test_transitions_off_lifts_the_transition_rule(tmp_path):
    job = load_job(write_job(tmp_path, BASE), ["chunking.transitions=false", "chunking.transition_frames=50"])
    assert job.spec.chunking.transitions is False


def test_missing_job_file(tmp_path):
    with pytest.raises(SpecError, match="no such file"):
        load_job(tmp_path / "nope.yaml")


@pytest.mark.parametrize("value, want", [(None, "auto"), ("true", True), ("false", False), ("auto", "auto")])
def test_transitions_take_a_bool_or_auto(tmp_path, value, want):
    """auto is the default; true/false as YAML bools (old job files) stay bools, so a resume's digest is unchanged."""
    job = load_job(write_job(tmp_path, BASE), [f"chunking.transitions={value}"] if value else [])
    assert job.spec.chunking.transitions == want and type(job.spec.chunking.transitions) is type(want)
