"""The timestep pipeline (`runtime.parallel: steps`): S + 1 ranks for an S-step streaming family (LiveAvatar's TPP).

Rank 0 decodes, publishes and checkpoints; rank 1 + s runs denoising step s of every block and keeps only that
step's key/value ring. A block travels through the ranks like a part down an assembly line:

    rank 1 (step 0): noise of block g -> x_1 ----send---> rank 2 (step 1): x_1 -> x_2 ---> ... rank S: x_S = z_g
    rank 0: <---- z_g ---- rank S;  decode z_g, put its frames in the MP4, save the resume point after g

so in steady state rank 1 works on block g + S - 1 while rank S works on block g and rank 0 decodes block g - 1:
one block leaves the line per step-forward, where one rank needs S forwards per block. Each step rank computes its
own block inputs (audio features, text) and its own copy of the sink (the prefill is the same for every step; it
runs at block 0 and once more at block 4 with the rolled sink frame, which the last step rank sends to the others).

Bit-identical to one rank (tests/test_steps_pipeline.py): every step runs the same operations on the same inputs as
`LiveAvatarFamily.denoise` does in one process; the ranks exchange tensors exactly (send/recv, no reduction).

Resume points. A checkpoint holds what one rank's render holds after block g, so a render resumes with either way:
each step rank sends rank 0 a copy of its ring after the blocks `copies` names (and step 0's rank the sink when it
changes), and rank 0 assembles the state in host memory; a live session, which never resumes, sends none. At full
size the rings are 41.5 GB (causal.py's docstring counts them), so `copies` is checkpoint.resume_schedule: one block
in 39 there, every block for a small model.

The ranks hand tensors on over a Wire (runtime/wire.py): sends are asynchronous (isend) with at most PENDING blocks
in flight per rank, so a rank runs ahead of its consumer by that much and no further, which bounds the memory the
copies in flight take. Receives block. The decode rank publishes each block through the loop's own PublishStep
(pipeline/publish.py), reference conditioning included.
"""

from collections.abc import Callable, Iterable

import torch

from avatar_cli.media.sink import now
from avatar_cli.families.base import Chunk, Family, RollingState, Sampling, Step
from avatar_cli.media.source import AudioSource
from avatar_cli.pipeline.events import ChunkDone, RenderStats, ResumeFrom, Stretch
from avatar_cli.pipeline.publish import PublishStep
from avatar_cli.runtime.distributed import Dist
from avatar_cli.runtime.placement import Placement
from avatar_cli.runtime.wire import Wire
from avatar_cli.stages.base import StageTimer, Steps
from avatar_cli.stages.prompt import PromptEncode
from avatar_cli.stages.publish import Publisher

PENDING = 2  # blocks a rank's sends may have in flight


DECODE_RANK = 0


def step_of(rank: int) -> int:
    """The denoising step rank `rank` (>= 1) runs."""
    return rank - 1


def ranks_needed(steps: int) -> int:
    return steps + 1


def check_family(family: Family) -> None:
    """ValueError naming the family and mode when it has no timestep pipeline."""
    if not family.step_pipeline:
        raise ValueError(f"runtime.parallel: steps: the {family.name} family's '{family.mode}' mode has no timestep "
                         "pipeline (only the wan-s2v streaming mode has); use sequence or auto")


def check_world(family: Family, steps: int, world: int) -> None:
    """ValueError naming the problem when this family and rank count cannot run the timestep pipeline."""
    check_family(family)
    if world != ranks_needed(steps):
        raise ValueError(f"runtime.parallel: steps: {steps} denoising steps need {ranks_needed(steps)} ranks (one per "
                         f"step and one that decodes), not {world}: launch with --nproc {ranks_needed(steps)}")


def choose_parallel(setting: str, family: Family, steps: int, world: int) -> tuple[str, str]:
    """`runtime.parallel` -> ("single" | "sequence" | "steps", why). ValueError for `steps` where it cannot run.

    auto picks the timestep pipeline exactly when the family has one and the ranks are one per step plus a decode
    rank: then no forward waits on a collective (a rank sends one block's latents per step-forward), where sequence
    parallel all-to-alls q, k, v twice per layer of every forward. Any other count: sequence."""
    if world == 1:
        return "single", "one rank"
    if setting == "steps":
        check_world(family, steps, world)
        return "steps", f"asked for; {world} ranks = {steps} denoising steps + a decode rank"
    if setting == "sequence":
        return "sequence", "asked for"
    if family.step_pipeline and world == ranks_needed(steps):
        return "steps", (f"auto: {world} ranks = {steps} denoising steps + a decode rank: each rank runs one step of "
                         "every block, no collective inside a forward")
    why = (f"{world} ranks, not {steps} steps + 1" if family.step_pipeline
           else f"the {family.name} family's '{family.mode}' mode has no timestep pipeline")
    return "sequence", f"auto: {why}"


def rank_skips(family: Family, rank: int) -> set[str]:
    """Components the timestep pipeline's rank `rank` never runs: the decode rank needs only the reference, refine
    and decode steps' (refine reads the reference); a step rank all but the decode-only ones."""
    needs = family.needs
    if rank == DECODE_RANK:
        keep = {n for step in (Step.reference, Step.sr, Step.decode) for n in needs.get(step, ())}
    else:
        keep = {n for step in (Step.reference, Step.prompt, Step.context, Step.a2v) for n in needs.get(step, ())}
    return set(family.components) - keep


def every_block(block: int) -> bool:  # noqa: ARG001
    return True


def run_steps(steps: Steps, prompt: PromptEncode, placement: Placement, dist_: Dist, spec, image: torch.Tensor,
              audio: AudioSource, chunks: Iterable[Chunk], out: Publisher, on_chunk: Callable[[ChunkDone], None],
              on_stretch: Callable[[Stretch], None], resume: ResumeFrom | None, timer: StageTimer,
              t0: float, copies: Callable[[int], bool] = every_block) -> RenderStats:
    """The timestep pipeline's part of Pipeline.run on this rank (module docstring): a step rank the reference,
    prompt, context and its denoising step, the decode rank the reference (which super-resolution reads),
    super-resolution and the decode; placed by `placement`; rank 0 publishes through `out`.

    chunks: the plan, a list or (a live session) the chunks as they are planned; every rank runs the same ones.
    copies(block): whether the step ranks send the decode rank their rings after that block, a schedule both
    sides know; a stretch published after another block carries no state to resume from (`Stretch.resumable`)."""
    s = spec.sampling
    sampling = Sampling(s.steps, s.guidance, s.shift)
    first = resume.next_chunk if resume else 0
    state = resume.state if resume else RollingState()
    if dist_.rank == DECODE_RANK:
        # Super-resolution keeps the reference in view, as in the loop: this rank encodes it too (rank_skips leaves
        # it the components) while the step ranks run the first block.
        with timer(Step.reference), placement.stage(steps.needs(Step.reference), then=steps.needs(Step.sr)):
            ref = _reference(steps, image)
        publish = PublishStep(steps, out, ref, placement, timer, on_chunk, on_stretch, t0, after=steps.needs(Step.sr))
        return _decode_rank(steps.family, dist_, spec.chunking, chunks, first, state, publish, copies)
    frames = _step_rank(steps, prompt, placement, dist_, spec, image, audio, chunks, first, state, sampling, timer,
                        copies)
    return RenderStats(frames=frames, wall_s=now() - t0, ttff_s=0.0, compute_s=dict(timer.seconds))


def _reference(steps: Steps, image: torch.Tensor):
    rt = steps.runtime
    return steps.family.reference(steps.models(Step.reference), image, rt.device, rt.dtype)


def _step_rank(steps: Steps, prompt: PromptEncode, placement: Placement, dist_: Dist, spec, image: torch.Tensor,
               audio: AudioSource, chunks: Iterable[Chunk], first: int, state: RollingState, sampling: Sampling,
               timer: StageTimer, copies: Callable[[int], bool]) -> int:
    """Runs step `rank - 1` of every block; returns the frames the plan published."""
    family, group, fps = steps.family, dist_.group, spec.video.fps
    step = step_of(dist_.rank)
    last = dist_.world_size - 1
    device = steps.runtime.device
    models, context = steps.models(Step.a2v), steps.models(Step.context)
    state = family.step_state(state, step)  # this step's ring only (a resumed state holds every step's)
    wire = Wire(group, device, pending=PENDING)
    stage = placement.stage
    dtype = next(models["dit"].parameters()).dtype
    with timer(Step.reference), stage(steps.needs(Step.reference)):
        ref = _reference(steps, image)
    with timer(Step.prompt), stage(prompt.needs_for(spec.prompt)):
        text = prompt.run(spec.prompt)
    published, rolled, took_frame = 0, False, False  # the last rank sent the sink frame / this rank took it
    try:
        for i, chunk in enumerate(chunks):
            if i < first:
                continue  # resumed after it
            if i == first:
                family.release_audio(context, audio, chunk.start - 1, fps)
            with timer(Step.context), stage(steps.needs(Step.context)):
                inputs = family.context(context, chunk, audio, fps, text, state, spec.seed, device, steps.runtime.dtype)
                family.release_audio(context, audio, chunk.start - 1, fps)
            with timer(Step.a2v), stage(steps.needs(Step.a2v)):
                if family.needs_sink_frame(chunk.index, state) and step != last - 1:
                    family.put_sink_frame(state, wire.recv(last, "sink_frame"))  # rolled by the last step's rank
                    took_frame = True
                x = family.block_noise(inputs, ref, dtype) if step == 0 else wire.recv(dist_.rank - 1, "x")
                x = family.denoise_step(models, inputs, ref, x, step, sampling, state, own_ring=True,
                                        rings=steps.rings)  # (16, 3, h, w)
            if dist_.rank == last:
                z = family.block_latents(inputs, ref, x)  # (F, 16, h, w)
                wire.send(DECODE_RANK, "z", z)
                frame = family.rolled_sink_frame(chunk.index, z)
                if frame is not None:  # sent whether or not a block uses it: the plan's length may be unknown
                    for r in range(1, last):
                        wire.send(r, "sink_frame", frame)
                    family.put_sink_frame(state, frame)
            else:
                wire.send(dist_.rank + 1, "x", x)
            rolled = rolled or chunk.index == family.sink_roll_block
            if copies(chunk.index):
                for name, t in family.step_tensors(state, step, chunk.index).items():  # for rank 0's checkpoint
                    wire.send(DECODE_RANK, name, t.clone())  # the ring changes in place at the next block
            wire.end_block()
            published = chunk.publish_to
        if rolled and not took_frame and step != last - 1:
            wire.recv(last, "sink_frame")  # the plan ended before the block that uses the rolled sink frame
    finally:
        wire.flush()
    return published


def _decode_rank(family: Family, dist_: Dist, chunking, chunks: Iterable[Chunk], first: int, state: RollingState,
                 publish: PublishStep, copies: Callable[[int], bool]) -> RenderStats:
    """Takes each block's final latents from the last step's rank (and, after the blocks `copies` names, every step
    rank's ring) and publishes them as the loop does."""
    wire = Wire(dist_.group, publish.steps.runtime.device)
    last = dist_.world_size - 1
    for i, chunk in enumerate(chunks):
        if i < first:
            continue
        z = wire.recv(last, "z")  # (F, 16, h, w) the block's final latents
        family.keep(chunk, z, state, chunking)
        resumable = copies(chunk.index)
        if resumable:  # into host memory one tensor at a time: they are for the checkpoint, not for this device
            per_step = [{name: wire.recv(1 + s, name).cpu() for name in family.step_tensor_names(s, chunk.index)}
                        for s in range(last)]
            family.merge_step_tensors(state, per_step, chunk.index)
        publish(chunk, i + 1, state, resumable)
        if resumable:
            family.drop_rings(state)  # the resume point has them; the next one gets fresh copies
    return publish.finish(state)
