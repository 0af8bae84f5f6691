"""bench/gpu_check.py's wan section (Wan2.2-S2V-14B on one GPU) and bench/wan_budget.py's counting, on the CPU.

The wan section waits for a session with a GPU; its smoke run takes every code path but CUDA's at the tiny sizes,
so the one lent run is not spent on a typo. The budget's meta-device counting is checked on small cases whose
answer is known, and its headline figures at full size (the README quotes them)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

BENCH = Path(__file__).parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import gpu_check  # noqa: E402
import wan_budget as wb  # noqa: E402
from avatar_cli.families.wan_s2v.dit import WanDiTParams, WanS2VDiT  # noqa: E402


def test_wan_section_runs_on_the_cpu_at_tiny_size_and_reports_every_figure():
    run = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--smoke", "--sections", "wan"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "Traceback" not in run.stdout + run.stderr
    lines = run.stdout.strip().splitlines()
    found = {m["measure"]: m for m in (json.loads(x) for x in lines if x.startswith('{"measure"'))}
    assert set(found) == {"wan matmul peak", "wan dit forward", "wan handoff dit->vae", "wan vae decode fp32",
                          "wan vae decode bf16", "wan vae encode fp32"}
    p = WanDiTParams.tiny()
    fwd = found["wan dit forward"]
    assert (fwd["tokens"], fwd["noisy_tokens"]) == wb.seq_len(p, wb.CLIP_TINY)
    # The count covers the convolutions and audio encoder that the closed formula leaves out, nothing less.
    assert fwd["flops"] >= fwd["formula_flops"] > 0
    assert fwd["output_finite"] is True and fwd["ms_median"] > 0 and fwd["tokens_per_s"] > 0
    assert found["wan matmul peak"]["bf16_tflops"] > 0 and fwd["of_matmul_peak"] > 0
    hand = found["wan handoff dit->vae"]
    assert hand["gap_ms"] >= 0 and hand["euler_ms"] >= 0 and hand["first_kernel"]
    frames = 4 * wb.CLIP_TINY.frames  # a continued timeline: 4 frames per latent
    assert hand["frames"] == frames
    for name in ("fp32", "bf16"):
        dec = found[f"wan vae decode {name}"]
        assert dec["frames"] == frames and dec["latents"] == wb.CLIP_TINY.frames and dec["ms_median"] > 0
    enc = found["wan vae encode fp32"]
    assert (enc["frames"], enc["latents"]) == (5, 2) and enc["ms_median"] > 0  # 1 + 4k frames -> 1 + k latents
    summary = json.loads(lines[-1])  # the last line: every figure, the markdown's rows
    assert summary["wan dit forward: tokens"] == fwd["tokens"] and "DiT forward" in summary["wan summary"]


def smoke_section(section, monkeypatch, capsys) -> tuple[dict[str, dict], str]:
    """Run one section in this process as --smoke runs it: its measurements by name, and its output."""
    monkeypatch.setattr(gpu_check, "DEV", torch.device("cpu"))
    monkeypatch.setattr(gpu_check, "SMOKE", True)
    monkeypatch.setattr(gpu_check, "RESULTS", {})
    section()
    out = capsys.readouterr().out
    return {m["measure"]: m for m in (json.loads(x) for x in out.splitlines() if x.startswith('{"measure"'))}, out


def test_weights_section_runs_on_the_cpu_at_tiny_size(monkeypatch, capsys):
    """bench/gpu_check.py's weights section (in this process, as --smoke runs it): each format's forward, its memory
    and its error against bf16."""
    found, out = smoke_section(gpu_check.weights, monkeypatch, capsys)
    assert set(found) == {"wan weights bf16", "wan weights int8", "wan weights fp8"}
    bf16, int8, fp8 = (found[f"wan weights {f}"] for f in ("bf16", "int8", "fp8"))
    assert bf16["rel_l2_vs_bf16"] == 0 and bf16["speed_vs_bf16"] == 1.0
    # the smoke run is float32: int8 keeps more of each weight than fp8 (e4m3), and neither is exact
    assert 0 < int8["rel_l2_vs_bf16"] < fp8["rel_l2_vs_bf16"] < 0.05
    assert int8["counted_bytes"] < bf16["counted_bytes"] and fp8["counted_bytes"] < bf16["counted_bytes"]
    assert all(m["output_finite"] and m["ms_median"] > 0 and m["quantize_s"] >= 0 for m in found.values())
    assert "weights summary: bf16" in out


def test_an_unknown_section_is_refused_by_name(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--smoke", "--sections", "wan,warp"])
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main()
    assert exit_.value.code == 2 and "--sections: unknown warp; choose from handoff," in capsys.readouterr().err


def test_handoff_gap_reads_the_kernels_between_the_markers_and_skips_the_decodes_copies():
    spin = "void at::cuda::(anonymous namespace)::spin_kernel(long)"
    events = [("ampere_bf16_gemm", 0.0, 900.0),  # the DiT's tail
              (spin, 900.0, 902.0), ("vectorized_elementwise_kernel", 902.0, 910.0),  # the Euler step
              (spin, 915.0, 917.0),
              ("Memcpy HtoD (Pageable -> Device)", 917.5, 918.0), ("Memcpy HtoD (Pageable -> Device)", 960.0, 961.0),
              ("cudnn_conv3d", 1017.0, 2000.0)]  # the decode's first kernel
    got = gpu_check.handoff_gap(events)
    assert got["euler_ms"] == pytest.approx(0.013) and got["gap_ms"] == pytest.approx(0.1)
    assert got["first_kernel"] == "cudnn_conv3d"
    with pytest.raises(RuntimeError, match="1 of 2 markers"):
        gpu_check.handoff_gap(events[:2])


def test_live_bytes_counts_allocations_not_views_and_forgets_what_is_freed():
    a = torch.empty(1000, device="meta")  # 4,000 bytes that exist before: not counted

    def work():
        b = a + 1  # 4,000 new
        b.view(10, 100).t()  # views: nothing new
        b.add_(1)  # in place: nothing new
        del b
        c = torch.empty(500, dtype=torch.float64, device="meta")  # 4,000 new, after b is gone
        return c.sum()  # 8 more while c lives

    assert wb.peak_bytes(work) == 4008


def test_fused_attention_holds_the_output_not_the_scores():
    q = torch.empty(1, 2, 1000, 64, device="meta", dtype=torch.bfloat16)  # (B, H, N, Dh)
    peak = wb.peak_bytes(lambda: F.scaled_dot_product_attention(q, q, q))
    assert peak == q.numel() * 2  # the output; the logsumexp (8 KB) is freed before it; 1000^2 scores would be 4 MB


def test_full_size_budget_figures_the_readme_quotes():
    """The 14B DiT on meta: parameter bytes, tokens and FLOPs of a 480p clip (counted from the release's shapes: bench/wan_budget.py)."""
    p = WanDiTParams.full()
    dit = wb.on_meta(WanS2VDiT, p, torch.bfloat16)
    assert wb.n_params(dit) == 16_295_755_609 and wb.n_bytes(dit) == 2 * 16_295_755_609
    n, noisy = wb.seq_len(p, wb.CLIP_480P)
    assert (n, noisy) == (32_760, 29_120)
    fl = wb.dit_flops(dit, wb.dit_inputs(p, wb.CLIP_480P, "meta"))
    assert fl["total"] == pytest.approx(1.715e15, rel=1e-3)
    assert fl["total"] == pytest.approx(wb.formula_flops(p, n, noisy, wb.CLIP_480P.frames), rel=1e-3)
    assert 0.5 < fl["attention"] / fl["total"] < 0.53


def test_sr_section_runs_on_the_cpu_at_tiny_size(monkeypatch, capsys):
    """bench/gpu_check.py's sr section as --smoke runs it (in this process): the tiny SwiftVR `models init` writes,
    built on meta and given random weights as at full size, streamed at two sizes in bf16 and int8: the first
    chunk's 25 frames, a middle chunk's 24, every input frame out at twice the size, the plan's count beside."""
    found, out = smoke_section(gpu_check.sr, monkeypatch, capsys)
    assert set(found) == {f"sr {f} {w}x{h}->{2 * w}x{2 * h}" for f in ("bf16", "int8")
                          for w, h in gpu_check.SR_SIZES_SMOKE}
    for name, m in found.items():
        w, h = (int(x) for x in name.split()[2].split("->")[1].split("x"))
        assert (m["first_frames_out"], m["middle_frames_out"]) == (25, 24) and m["out_shape"] == [3, h, w]
        assert m["frames_out"] == m["frames_in"] and m["output_finite"] is True
        assert m["fps"] > 0 and m["first_chunk_ms"] > 0 and m["predicted_above_weights_gb"] >= 0
    assert "sr bf16 summary: bf16 64x32->128x64" in out and "sr int8 summary" in out
