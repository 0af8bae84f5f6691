"""Eval metrics on inputs whose answer is known: generator output, shuffled video, constructed seams."""

import numpy as np
import torch

from avatar_cli.evaluate import metrics as M
from avatar_cli.synth import make_clip


def _clip():
    return make_clip(3, 3, 4.0, 25, size=96)


def test_lip_sync_high_on_generator_output_low_when_shuffled():
    c = _clip()
    good = M.lip_sync(c.frames, c.reference, c.audio, c.sample_rate, c.fps)
    perm = np.random.default_rng(0).permutation(c.frames.shape[0])
    bad = M.lip_sync(c.frames[perm], c.reference, c.audio, c.sample_rate, c.fps)
    assert good > 0.6, good
    assert abs(bad) < 0.3, bad


def test_drift_ratio_flags_a_face_that_fades():
    c = _clip()
    steady = M.face_error(c.frames, c.reference)
    base = M.drift_ratio(steady, 25.0)[0]
    fading = c.frames.float()
    fading = (fading * torch.linspace(1.0, 0.5, len(fading))[:, None, None, None]).to(torch.uint8)
    assert M.drift_ratio(M.face_error(fading, c.reference), 25.0)[0] > 2 * base
    assert M.drift_ratio(np.full(100, 5.0), 25.0) == (1.0, 5.0, 5.0)


def test_seam_ratio_sees_jumps_at_chunk_boundaries():
    rng = np.random.default_rng(0)
    smooth = np.cumsum(rng.normal(0, 1, (96, 8, 8, 3)), axis=0)
    n_seams = [24, 48, 72]
    assert M.seam_ratio(M.frame_changes(np.clip(smooth + 128, 0, 255)), n_seams) < 1.3
    jumpy = smooth.copy()
    for k in range(1, 4):
        jumpy[24 * k:] += 20.0 * (-1) ** k
    ratio = M.seam_ratio(M.frame_changes(np.clip(jumpy + 128, 0, 255)), n_seams)
    assert ratio > 3.0, ratio
    # A jump where an I chunk hands back to its N chunk counts too, once its boundary is listed.
    late = smooth.copy()
    late[30:] += 20.0
    assert M.seam_ratio(M.frame_changes(np.clip(late + 128, 0, 255)), n_seams) < 1.3
    assert M.seam_ratio(M.frame_changes(np.clip(late + 128, 0, 255)), n_seams + [30]) > 2.0


def test_chunk_boundaries_are_where_the_output_changes_chunk():
    from avatar_cli.families.mini.schedule import plan

    assert M.chunk_boundaries(plan(80, 24, 4, False, 6)) == [24, 48, 72]
    # With I chunks: into I(k-1) at kF, and back into N(k) after its 6 frames.
    assert M.chunk_boundaries(plan(80, 24, 4, True, 6)) == [24, 30, 48, 54, 72, 78]


def test_psnr_and_direction():
    x = torch.zeros(2, 3, 8, 8)
    assert M.psnr(x, x + 0.02) > 40
    assert abs(M.psnr(x, x + 2 * 10 ** (-30 / 20)) - 30.0) < 1e-6
    base, truth = np.zeros(10), np.zeros(10)
    up = np.arange(10.0)
    assert M.direction_score(up, base, up * 2, truth) > 0.99
    assert M.direction_score(-up, base, up, truth) < -0.99


def test_motion_energy_higher_for_lively():
    calm = make_clip(4, 4, 3.0, 25, size=96, expression="neutral", energy="calm")
    lively = make_clip(4, 4, 3.0, 25, size=96, expression="neutral", energy="lively")
    assert M.motion_energy(lively.frames, lively.reference) > M.motion_energy(calm.frames, calm.reference)


def test_contact_sheet_shape():
    frames = [np.full((10, 10, 3), i, np.uint8) for i in range(6)]
    sheet = M.contact_sheet(frames, columns=4)
    assert sheet.shape == (2 * 12 + 2, 4 * 12 + 2, 3)
    assert sheet[2, 2, 0] == 0 and sheet[2 + 12, 2, 0] == 4
