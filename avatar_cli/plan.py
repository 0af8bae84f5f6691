"""`avatar plan JOB --gpus 5x24GB`: the layout a render of JOB would choose on a machine you may not have yet, what
it needs of each GPU and of the host, and how fast it would go, each choice with its reason.

Nothing here decides anything of its own. The choices are the render's, made by the same functions from the same
kind of input:
- how the ranks split the work: job.resolve_parallel (pipeline/steps.py choose_parallel);
- shard or replicate, offload none / model / block: runtime/placement.py choose_layout (runtime/sharding.py,
  runtime/offload.py), fed the models' sizes as a render feeds it those of the models it loaded;
- where the blocks wait under block offload: runtime/offload.py host_tier_choice;
- where the decode runs: job.resolve_decode (stages/decode_worker.py choose);
- the text encoder: the job's runtime.text_service and runtime.text_cache, as prompts/cache.py reads them.
- the working set each rank keeps free, and where the rings wait: runtime/job_budget.py, which the render calls too.
- super-resolution (`sr.model`): on the rank that decodes, beside the decode (in the render process, or in the decode
  worker), its models placed with that rank's others; counted on meta by avatar_cli/sr/swiftvr/budget.py (`sr.model:
  swiftvr` names the release's size without weights).
The sizes, activation peaks and FLOPs come from the family's budget (runtime/budget.py), every model built on the
meta device at full size (families/wan_s2v/budget.py): no weights, no GPU; a job's `dit:` file is counted in the
format it is stored in, from its header. What a GPU would do with them (its peak FLOP/s, the link to the host) is
an assumption, printed with the figures: the card's vendor peak at a utilisation (`--util`, default 40 %), from the
catalogue gpus.toml.

A job names its model as for a render (a model directory), or by the release's size (`model: wan-s2v-14b`, or
`--model wan-s2v-14b` here): someone with no weights yet plans against the size they would download.
"""

import functools
import re
import tomllib
from dataclasses import asdict, dataclass, field, replace
from importlib import resources

import torch

from avatar_cli.errors import InputError
from avatar_cli.families.base import Step
from avatar_cli.families.registry import resolve_model, with_dit, with_mode
from avatar_cli.job import Split, resolve_decode, resolve_parallel
from avatar_cli.pipeline.steps import rank_skips
from avatar_cli.runtime.budget import GB, HOST_RESERVE, Budget, ModelBytes, SRBudget
from avatar_cli.runtime.device import Runtime, auto_dtype
from avatar_cli.runtime.job_budget import job_budget, job_working_set, place_rank0, rank_layout, sr_decode
from avatar_cli.runtime.offload import host_tier_choice
from avatar_cli.runtime.placement import Layout
from avatar_cli.spec import Job

GIB = 2**30
CUDA_CONTEXT = 1 * GB  # the CUDA context and cuBLAS/cuDNN workspaces: held on every GPU before any tensor


@dataclass(frozen=True)
class Card:
    """What the speed figures assume of a GPU: vendor figures, not measurements (gpus.toml says each one's)."""

    name: str
    bf16_tflops: float  # dense bf16 tensor-core peak
    host_gbs: float  # host -> GPU copies from pinned memory (PCIe), GB/s
    peer_gbs: float  # GPU <-> GPU for all-gathers and all-to-alls, GB/s one way


@functools.cache
def catalogue() -> dict:
    """The package's gpus.toml: {"cards": {GiB: Card}, "unknown": {links of a card given by --tflops}, "disk_gbs"}."""
    data = tomllib.loads(resources.files("avatar_cli").joinpath("gpus.toml").read_text(encoding="utf-8"))
    return {"cards": {int(gib): Card(**c) for gib, c in data["cards"].items()}, "unknown": data["unknown"],
            "disk_gbs": float(data["disk_gbs"])}


def cards() -> dict[int, Card]:
    """The cards a plan knows, keyed by memory (GiB): the one a plan for that size assumes unless told otherwise
    (--tflops, --link-gbs)."""
    return catalogue()["cards"]


DISK_GBS = catalogue()["disk_gbs"]


@dataclass(frozen=True)
class Machine:
    gpus: int
    gpu_bytes: int  # each GPU's memory (a "24GB" card has 24 GiB)
    card: Card
    host_bytes: int | None = None  # host memory; None: not given
    disk_gbs: float = DISK_GBS

    @property
    def label(self) -> str:
        return f"{self.gpus}x{self.gpu_bytes // GIB}GB"

    @property
    def usable(self) -> int:
        return self.gpu_bytes - int(CUDA_CONTEXT)


def parse_size(text: str, what: str) -> int:
    """'24GB', '24G', '24' -> bytes (GiB: memory is sold in binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:gb|gib|g)?\s*", text, re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise InputError(f"{what}: '{text}': expected a size such as 24GB")
    return int(float(m.group(1)) * GIB)


def machine(gpus: str, host_memory: str | None = None, tflops: float | None = None, link_gbs: float | None = None,
            disk_gbs: float = DISK_GBS) -> Machine:
    """`--gpus NxSIZE` (5x24GB, 1x80GB), the host's memory, and what to assume of the card."""
    m = re.fullmatch(r"\s*(\d+)\s*[x×*]\s*(.+)", gpus, re.IGNORECASE)
    if not m or int(m.group(1)) < 1:
        raise InputError(f"--gpus: '{gpus}': expected COUNTxSIZE, such as 1x24GB or 8x80GB")
    n, size = int(m.group(1)), parse_size(m.group(2), "--gpus")
    known = cards()
    card = known.get(round(size / GIB))
    if card is None:
        if tflops is None:
            raise InputError(f"--gpus: no card of {size / GIB:g} GB is known here ({', '.join(f'{k}GB' for k in known)}"
                             "): give its bf16 peak with --tflops")
        card = Card(f"a {size / GIB:g} GB card", tflops, **catalogue()["unknown"])
    if tflops is not None or link_gbs is not None:
        card = replace(card, name=card.name + " (figures as given)", bf16_tflops=tflops or card.bf16_tflops,
                       peer_gbs=link_gbs or card.peer_gbs)
    host = parse_size(host_memory, "--host-memory") if host_memory else None
    return Machine(n, size, card, host, disk_gbs)


@dataclass
class RankPlan:
    """One kind of rank: its models' layout and what it holds on its GPU at its fullest."""

    role: str  # "every rank", "a step rank", "the decode rank"
    count: int
    models: list[str]
    sharded: list[str]
    offload: str
    shard_why: str
    offload_why: str
    weights_bytes: int  # model weights on the device at its fullest
    state_bytes: int  # rolling state kept between chunks
    work_bytes: int  # the largest stage's activations
    worker_bytes: int = 0  # a decode worker sharing this GPU
    host_bytes: int = 0  # what this rank keeps in host memory (offloaded weights, pinned or staging)

    @property
    def gpu_bytes(self) -> int:
        return int(CUDA_CONTEXT) + self.weights_bytes + self.state_bytes + self.work_bytes + self.worker_bytes


@dataclass
class Plan:
    job: str
    model: str
    family: str
    mode: str
    size: tuple[int, int]
    machine: str
    card: str
    utilisation: float
    parallel: str
    parallel_why: str
    decode: str
    decode_why: str
    vae_dtype: str  # the decode's dtype (runtime.vae_dtype)
    text: str
    text_why: str
    weights: str
    weights_why: str
    host_tier: str
    host_tier_why: str
    ranks: list[RankPlan]
    model_bytes: dict[str, int]  # each model's weights as a render holds them (a `dit:` file's in its own format)
    gpu_bytes: int  # the fullest GPU
    gpu_capacity: int
    host_bytes: int  # host memory the layout needs (with HOST_RESERVE)
    host_capacity: int | None
    fits: bool
    speed: dict  # clip mode: seconds per clip; streaming: fps; with how each term was worked out
    sr: dict | None = None  # the job's super-resolution: where it runs, its output size and bytes; None: no sr.model
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        d = asdict(self)
        d["ranks"] = [{**asdict(r), "gpu_bytes": r.gpu_bytes} for r in self.ranks]
        return d


def plan_source(job: Job):
    """The job's model in its mode (a size name resolves too: `model: wan-s2v-14b`), with its `dit:` file (its header
    checked against the DiT, as a render checks it); no LoRA file is opened."""
    source = job.source if job.source is not None else resolve_model(job.model, job.path.parent)  # says why not
    if job.dit is not None:
        source = with_dit(source, job.dit, job.spec.runtime.weights.value)
    return with_mode(source, job.spec.mode)


def _frame_size(job: Job, family) -> tuple[int, int]:
    """The size the render generates at: video.width/height, else from the reference's aspect (its header only;
    the family's native aspect when the file is not there yet)."""
    v = job.spec.video
    requested = (v.width, v.height) if v.width else None
    try:
        from PIL import Image  # the header only: no pixels decoded

        with Image.open(job.reference) as im:
            wh = im.size
    except OSError:
        wh = family.geometry.native_size
    try:
        return family.frame_size(wh, requested)
    except ValueError as e:
        raise InputError(f"{job.path}: {e}") from None


def _sr_budget(job: Job, size: tuple[int, int], dtype: torch.dtype) -> SRBudget | None:
    """The job's `sr.model` counted at the family's frame size (None: no super-resolution): a SwiftVR directory
    from its config (its headers checked, as a render checks them), or `swiftvr`, the release's size."""
    sr = job.spec.sr
    if sr.model is None:
        return None
    from avatar_cli.sr.swiftvr.budget import SIZE_NAME, is_size_name, sr_budget  # meta counting: paid only with sr.model

    directory = None if is_size_name(sr.model, job.sr_model) else job.sr_model
    if directory is not None and not directory.is_dir():
        raise InputError(f"sr.model: {directory}: not a directory (a SwiftVR model directory, or '{SIZE_NAME}' for "
                         "the release's size without weights)")
    try:
        return sr_budget(directory, size, sr.scale, dtype, job.spec.runtime.weights.value)
    except ValueError as e:  # a scale or a size the model cannot do
        raise InputError(f"sr: {e}") from None


def _sr_where(split: str, decode: str, gpus: int) -> str:
    if split == "steps":
        return "the decode rank"
    if decode == "worker":
        return "the decode worker (rank 0's GPU)"
    return "the GPU" if gpus == 1 else "rank 0"


def _text_choice(job: Job) -> tuple[str, str]:
    rt = job.spec.runtime
    if rt.text_service.url:
        return "service", f"runtime.text_service: {rt.text_service.url} encodes prompts; no render loads the encoder"
    if rt.text_cache != "off":
        return "cache", ("runtime.text_cache: a cached prompt's render never loads the text encoder; "
                         "`avatar prompts encode JOB` fills the cache first (the encoder alone on one GPU, below)")
    return "load", "runtime.text_cache: off: every render loads the text encoder beside the DiT"


def _rank(role: str, count: int, sizes: dict[str, ModelBytes], layout: Layout, state: int, work: int,
          worker: int = 0) -> RankPlan:
    return RankPlan(role, count, sorted(sizes), list(layout.sharded), layout.offload, layout.shard_why,
                    layout.offload_why, layout.weights_peak(), state, work, worker)


def _host_tier(job: Job, m: Machine, ranks: list[RankPlan], sizes: dict[str, ModelBytes], source, layouts,
               extra: int = 0) -> tuple[str, str]:
    """Fill in each rank's host bytes under the tier the render would choose, and return (tier, why). extra: host
    memory pinned besides (rings in host memory)."""
    pinned = {}
    for r, lay in zip(ranks, layouts):
        per = 0
        for n in r.models:
            if lay.offload == "none":
                continue
            # FSDP2's CPU offload keeps a rank's shard on the host; an offloaded replica is there whole.
            per += sizes[n].total // (r.count if n in lay.sharded else 1) if n in lay.sharded else sizes[n].total
        pinned[r.role] = per
    total_pinned = sum(pinned[r.role] * r.count for r in ranks)
    blocked = any(lay.offload == "block" for lay in layouts)
    mappable = None
    if job.spec.runtime.weights.value != "bf16":
        mappable = f"runtime.weights: {job.spec.runtime.weights.value} quantizes the weights at load"
    elif not blocked:
        mappable = "no model is streamed block by block"
    elif "dit" in sizes and sizes["dit"].stored_quantized:
        mappable = f"dit: {job.dit}: its quantized weights are read whole at load, not mapped from the file"
    setting = job.spec.runtime.offload_host.value
    if not blocked and setting == "auto":
        tier, why = ("pinned", "idle models wait in pinned host memory") if total_pinned else ("", "nothing offloaded")
    else:
        try:
            tier, why = host_tier_choice(setting, m.host_bytes, total_pinned + extra + int(HOST_RESERVE), mappable)
        except ValueError as e:
            raise InputError(str(e)) from None
    for r, lay in zip(ranks, layouts):
        r.host_bytes = pinned[r.role]
        if tier == "mmap" and lay.offload == "block":
            dit = sizes.get("dit")
            if dit is not None and "dit" in r.models and "dit" not in lay.sharded:
                # the blocks stay in the file; a staging pair of the largest block in pinned memory
                r.host_bytes += 2 * dit.block - dit.blocks_total
    return tier, why


def _forward_s(b: Budget, m: Machine, util: float, ranks: int, r: RankPlan, sizes: dict[str, ModelBytes],
               tier: str, host_free: int | None) -> tuple[float, str]:
    """One DiT forward on `ranks` GPUs: compute, or the copies that feed it where they take longer (they overlap)."""
    compute = b.forward_flops / (ranks * util * m.card.bf16_tflops * 1e12)
    dit = sizes["dit"]
    how = f"compute {compute:.3f} s ({b.forward_flops / 1e12:.1f} TFLOP at {util:.0%} of {m.card.bf16_tflops:g} TFLOP/s"
    how += f" x {ranks})" if ranks > 1 else ")"
    moved, rate, what = 0.0, 1.0, ""
    if "dit" in r.sharded:
        gather = dit.blocks_total * (ranks - 1) / ranks
        t = gather / (m.card.peer_gbs * GB)
        how += f"; all-gather {gather / GB:.1f} GB at {m.card.peer_gbs:g} GB/s"
        if r.offload != "none":  # and before it, the rank's shard from the host
            t += dit.blocks_total / ranks / (m.card.host_gbs * GB)
            how += f" after the shard's copy from the host ({dit.blocks_total / ranks / GB:.1f} GB at {m.card.host_gbs:g} GB/s)"
        how += f" = {t:.3f} s"
        return max(compute, t), how
    elif r.offload == "block" and "dit" in r.models:
        moved, rate, what = dit.blocks_total, m.card.host_gbs, "block copies from pinned memory"
        if tier == "mmap":
            cached = host_free is not None and host_free - r.host_bytes * r.count - HOST_RESERVE >= dit.blocks_total
            rate = min(m.card.host_gbs, 10.0) if cached else m.disk_gbs
            what = ("block copies from the page cache" if cached else
                    f"block reads from disk at {m.disk_gbs:g} GB/s (the page cache cannot hold the blocks)")
    if not moved:
        return compute, how
    t = moved / (rate * GB)
    how += f"; {what}: {moved / GB:.1f} GB at {rate:g} GB/s = {t:.3f} s"
    return max(compute, t), how


def _sr_s(sr: SRBudget, m: Machine, util: float, offload: str) -> tuple[float, str]:
    """One super-resolution chunk on one GPU: its compute, or its transformer's copies from the host where its
    rank offloads (block: its blocks; model: the whole transformer), which overlap it."""
    compute = sr.flops / (util * m.card.bf16_tflops * 1e12)
    how = (f"a {sr.chunk_frames}-frame chunk: compute {compute:.3f} s ({sr.flops / 1e12:.1f} TFLOP at {util:.0%} of "
           f"{m.card.bf16_tflops:g} TFLOP/s)")
    dit = sr.models["sr_dit"]
    moved = dit.blocks_total if offload == "block" else dit.total if offload == "model" else 0
    if not moved:
        return compute, how
    t = moved / (m.card.host_gbs * GB)
    return max(compute, t), how + (f"; its transformer from the host: {moved / GB:.1f} GB at "
                                   f"{m.card.host_gbs:g} GB/s = {t:.3f} s")


def _speed(b: Budget, m: Machine, util: float, p_split: str, decode: str, ranks: list[RankPlan],
           sizes: dict[str, ModelBytes], tier: str, rings_at: str = "device", sr: SRBudget | None = None,
           sr_offload: str = "none") -> dict:
    dit_rank = next(r for r in ranks if "dit" in r.models)
    world = m.gpus if p_split == "sequence" else 1
    fwd, how = _forward_s(b, m, util, world, dit_rank, sizes, tier, m.host_bytes)
    if rings_at != "device":  # each forward brings its step's ring and the sink in, layer by layer
        rate = m.card.host_gbs if rings_at == "host" else m.disk_gbs  # disk: as if the page cache held none
        t = b.ring_layer * sizes["dit"].blocks / (rate * GB)
        fwd += t
        how += f"; rings from {'host memory' if rings_at == 'host' else 'disk'} {t:.3f} s"
    # The VAE in float32 runs its convolutions as TF32, half the bf16 rate on these cards; whole on one GPU.
    dec = b.decode_flops / (util * m.card.bf16_tflops / (2 if b.models["vae"].dtype == "float32" else 1) * 1e12)
    extra = {}
    if sr is not None:  # it runs after the decode, where the decode runs: the decode's time grows by it
        chunk_s, sr_how = _sr_s(sr, m, util, sr_offload)
        sr_t = chunk_s * b.chunk_frames / sr.chunk_frames
        dec += sr_t
        extra = {"sr_s": round(sr_t, 4), "sr": f"{sr_how}; {sr_t:.3f} s for {b.chunk_frames} frames"}
    video_s = b.chunk_frames / b.fps
    if b.mode == "streaming":
        block = b.forwards * fwd
        if p_split == "steps":
            per, why = max(fwd, dec), "one block leaves the line per step-forward; the decode rank keeps pace"
        elif decode == "worker":
            per, why = max(block, dec), "the decode overlaps the next block's forwards"
        else:
            per, why = block + dec, "forwards, then the decode, one after the other"
        fps = b.chunk_frames / per
        return {"fps": round(fps, 2), "realtime": fps >= b.fps, "forward_s": round(fwd, 4), "decode_s": round(dec, 4),
                "forward": how, "why": f"{b.chunk_frames} frames per block, {b.forwards} forwards; {why}", **extra}
    clip = b.forwards * fwd + dec
    return {"clip_s": round(clip, 1), "video_s_per_clip": video_s, "seconds_per_video_second": round(clip / video_s, 2),
            "forward_s": round(fwd, 4), "decode_s": round(dec, 3), "forward": how,
            "why": f"{b.forwards} DiT forwards per {b.chunk_frames}-frame clip, then its decode and motion re-encode "
                   "(the next clip waits on them)" + (", and its super-resolution" if sr is not None else ""), **extra}


def make_plan(job: Job, m: Machine, util: float = 0.4) -> Plan:
    """The plan for `job` on `m` (the job loaded as for a render; `model=wan-s2v-14b` names the release's size)."""
    if not 0 < util <= 1:
        raise InputError(f"--util: {util}: expected a share of the peak in (0, 1]")
    source = plan_source(job)
    spec = source.spec
    if spec.budget is None:
        raise InputError(f"plan: the {spec.name} family has no budget to plan with (it renders on a CPU; "
                         "`avatar render` runs it anywhere)")
    family = source.family
    rt = job.spec.runtime
    dtype, dtype_why = (auto_dtype("cuda") if rt.dtype.value == "auto"
                        else (getattr(torch, rt.dtype.value), "asked for"))
    runtime = Runtime(torch.device("cuda"), dtype, dtype_why)
    split, split_why = resolve_parallel(job, source, m.gpus)
    size = _frame_size(job, family)
    weights = rt.weights.value
    b = job_budget(job, source, size, dtype)
    sr = _sr_budget(job, size, dtype)
    text, text_why = _text_choice(job)
    text_names = set(family.needs[Step.prompt])
    loaded = {n: b.models[n] for n in family.components if text == "load" or n not in text_names}
    decode, decode_why = _decode(job, family, runtime, split, b, m, sr, loaded)
    # The super-resolution's models join the models of the rank that decodes, in the render process (a decode
    # worker holds them in its own: counted in its working set)
    sr_models = dict(sr.models) if sr is not None and decode == "inline" else {}
    free = m.usable
    ranks, layouts = [], []
    rings_at, rings_why = "device", ""
    if split == Split.steps:
        for role, rank, count in (("a step rank", 1, m.gpus - 1), ("the decode rank", 0, 1)):
            keep = {n: s for n, s in loaded.items() if n not in rank_skips(family, rank)}
            if rank == 0:
                keep |= sr_models
            ws = job_working_set(b, family, split, m.gpus, rank, decode, sr=sr)
            layouts.append(rank_layout(keep, family, rt, 1, free, sum(ws)))
            ranks.append(_rank(role, count, keep, layouts[-1], *ws))
    else:  # rank 0 is the fullest (a decode worker shares its GPU): every rank is planned as it
        here = loaded | sr_models
        r0 = place_rank0(b, family, rt, split, m.gpus, decode, here, free, m.host_bytes, sr)
        rings_at, rings_why = r0.rings_at, r0.rings_why
        layouts.append(r0.layout)
        ranks.append(_rank("every rank" if m.gpus > 1 else "the GPU", m.gpus, here, r0.layout, *r0.working))
    tier, tier_why = _host_tier(job, m, ranks, loaded | sr_models, source, layouts,
                                b.state if rings_at == "host" else 0)
    if rings_at != "device":
        ranks[0].host_bytes += b.state if rings_at == "host" else b.sink  # pinned; or the sink beside the file
    gpu = max(r.gpu_bytes for r in ranks)
    host = sum(r.host_bytes * r.count for r in ranks) + int(HOST_RESERVE)
    # the decode rank is planned last; a decode worker holds the super-resolution resident
    sr_offload = layouts[-1 if split == Split.steps else 0].offload if sr_models else "none"
    speed = _speed(b, m, util, split.value, decode, ranks, loaded, tier, rings_at, sr, sr_offload)
    fits = gpu <= m.gpu_bytes and (m.host_bytes is None or host <= m.host_bytes)
    notes = _notes(job, m, util, b, rings_at, rings_why, text, text_names, gpu, host, fits)
    return Plan(job=str(job.path), model=source.name, family=spec.name, mode=source.mode, size=size,
                machine=m.label, card=m.card.name, utilisation=util, parallel=split.value, parallel_why=split_why,
                decode=decode, decode_why=decode_why, vae_dtype=b.models["vae"].dtype, text=text, text_why=text_why,
                weights=_weights_label(job, weights, b, dtype), weights_why=_weights_why(job, weights, b, dtype_why),
                host_tier=tier, host_tier_why=tier_why, ranks=ranks,
                model_bytes={n: s.total for n, s in (b.models | (sr.models if sr else {})).items()}, gpu_bytes=gpu,
                gpu_capacity=m.gpu_bytes, host_bytes=host,
                host_capacity=m.host_bytes, fits=fits, speed=speed, notes=notes,
                sr=_sr_line(job, sr, _sr_where(split.value, decode, m.gpus), sr_offload) if sr is not None else None)


def _notes(job: Job, m: Machine, util: float, b: Budget, rings_at: str, rings_why: str, text: str,
           text_names: set[str], gpu: int, host: int, fits: bool) -> list[str]:
    """What the plan adds below its table: the rings off the device, the text encoder alone, what does not fit and
    the smaller settings that might."""
    notes = list(b.notes)
    rt = job.spec.runtime
    if rings_at != "device":
        where = "pinned host memory" if rings_at == "host" else "a memory-mapped scratch file (the page cache)"
        notes.append(f"runtime.rings: {rings_at} ({rings_why}): {b.state / GB:.1f} GB in {where}, "
                     f"{b.ring_layer / GB:.2f} GB brought in per layer")
    if text == "cache" and text_names:
        t = sum(b.models[n].total for n in text_names)
        notes.append(f"`avatar prompts encode` loads the text encoder alone: {t / GB:.1f} GB "
                     f"({'fits' if t + CUDA_CONTEXT < m.gpu_bytes else 'does not fit'} one GPU)")
    if gpu > m.gpu_bytes:
        notes.append(f"does not fit: the fullest GPU needs {gpu / GB:.1f} GB of {m.gpu_bytes / GB:.1f} GB")
    if m.host_bytes is not None and host > m.host_bytes:
        notes.append(f"does not fit: the host needs {host / GB:.1f} GB of {m.host_bytes / GB:.1f} GB")
    if not fits and (rt.weights.value == "bf16" or rt.vae_dtype.value != "bfloat16"):
        notes.append(_smaller(job, m, util))
    return notes


def _decode(job: Job, family, runtime: Runtime, split: Split, b: Budget, m: Machine, sr: SRBudget | None,
            loaded: dict[str, ModelBytes]) -> tuple[str, str]:
    """Where the decode runs, as a render on this machine decides it: `runtime.decode` resolved, then auto's worker
    given up for inline where it cannot hold the super-resolution beside the DiT (render/setup.py `fit_decode`)."""
    decode, why = resolve_decode(job, family, runtime, split)
    rt = job.spec.runtime
    if sr is not None and decode == "worker" and rt.decode.value == "auto":
        inline = sr_decode(b, family, rt, split, m.gpus, m.usable, m.host_bytes, sr, loaded)
        if inline is not None:
            return "inline", inline
    return decode, why


def _sr_line(job: Job, sr: SRBudget, where: str, offload: str) -> dict:
    """What the plan says of the super-resolution: where it runs and what it adds there (its weights, the state it
    carries, its largest chunk's activations), counted on meta."""
    return {"model": str(job.spec.sr.model), "scale": sr.scale, "size": list(sr.out_size), "where": where,
            "offload": offload,
            "weights_bytes": sum(x.total for x in sr.models.values()), "state_bytes": sr.state,
            "work_bytes": sr.peak, "flops": sr.flops, "chunk_frames": sr.chunk_frames}


def _smaller(job: Job, m: Machine, util: float) -> str:
    """What the smallest settings would need on the same machine: int8 weights and a bf16 VAE decode."""
    from avatar_cli.spec import VaeDType, Weights  # the enums of the keys it sets

    keys = "runtime.weights=int8 runtime.vae_dtype=bfloat16"
    rt = replace(job.spec.runtime, weights=Weights.int8, vae_dtype=VaeDType.bfloat16)
    small = make_plan(replace(job, spec=replace(job.spec, runtime=rt)), m, util)
    if small.fits:
        return f"with {keys}: it fits ({small.gpu_bytes / GB:.1f} GB per GPU, {small.host_bytes / GB:.1f} GB of host)"
    return (f"with {keys} it still does not fit ({small.gpu_bytes / GB:.1f} GB per GPU, "
            f"{small.host_bytes / GB:.1f} GB of host): more GPUs, or bigger ones")


def _weights_label(job: Job, weights: str, b: Budget, dtype: torch.dtype) -> str:
    if job.dit is not None and b.models["dit"].stored_quantized:
        return b.models["dit"].dtype  # the file's format ("scaled FP8", "GGUF Q4_K")
    return weights if weights != "bf16" else _dtype_label(dtype)


def _weights_why(job: Job, weights: str, b: Budget, dtype_why: str) -> str:
    dit = b.models["dit"]
    if job.dit is not None and dit.stored_quantized:
        return (f"dit: {job.dit}: the DiT {dit.total / GB:.1f} GB, its quantized weights kept as the file stores them "
                f"(counted from its header), the rest in the runtime dtype ({dtype_why}); replicated, never sharded")
    if weights == "bf16":
        return (f"runtime.weights: bf16 (as loaded; runtime.dtype: {dtype_why}): the DiT {dit.total / GB:.1f} GB; "
                "fp8 or int8 would about halve it")
    return (f"runtime.weights: {weights}: the DiT's block Linears quantized at load (torchao), {dit.total / GB:.1f} "
            "GB; quantized weights are replicated, never sharded")


def _dtype_label(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))


def format_plan(p: Plan) -> str:
    """The plan in words, one choice a line with its reason."""
    w, h = p.size
    lines = [f"plan: {p.job} on {p.machine} ({p.card}); {p.family} {p.mode} mode ({p.model}) at {w}x{h}"]
    lines.append(f"  split     {p.parallel:9} {p.parallel_why}")
    for r in p.ranks:
        who = f"{r.role} (x{r.count})" if r.count > 1 else r.role
        lines.append(f"  {who}: {', '.join(r.models)}")
        lines.append(f"    shard   {', '.join(r.sharded) or 'none':9} {r.shard_why}")
        lines.append(f"    offload {r.offload:9} {r.offload_why}")
        lines.append(f"    memory  {r.gpu_bytes / GB:6.1f} GB of {p.gpu_capacity / GB:.1f}: weights "
                     f"{r.weights_bytes / GB:.1f}, state {r.state_bytes / GB:.1f}, activations {r.work_bytes / GB:.1f}"
                     + (f", decode worker {r.worker_bytes / GB:.1f}" if r.worker_bytes else "")
                     + f", CUDA context {CUDA_CONTEXT / GB:.1f}")
    lines.append(f"  weights   {p.weights:9} {p.weights_why}")
    if p.host_tier:
        lines.append(f"  host tier {p.host_tier:9} {p.host_tier_why}")
    lines.append(f"  decode    {p.decode:9} {p.decode_why}; the VAE in {p.vae_dtype} (runtime.vae_dtype)")
    lines.append(f"  text      {p.text:9} {p.text_why}")
    if p.sr is not None:
        s, (w2, h2) = p.sr, p.sr["size"]
        lines.append(f"  sr        x{s['scale']:<8} {s['model']} to {w2}x{h2}, on {s['where']}: weights "
                     f"{s['weights_bytes'] / GB:.1f} GB, state {s['state_bytes'] / GB:.1f}, activations "
                     f"{s['work_bytes'] / GB:.1f} ({s['chunk_frames']}-frame chunk, {s['flops'] / 1e12:.1f} TFLOP)")
    cap = f" of {p.host_capacity / GB:.1f}" if p.host_capacity else ""
    lines.append(f"  host      {p.host_bytes / GB:.1f} GB{cap} (offloaded weights, and {HOST_RESERVE / GB:.0f} GB for "
                 "the process)")
    s = p.speed
    if "fps" in s:
        lines.append(f"  speed     {s['fps']:.1f} fps ({'real time' if s['realtime'] else 'slower than real time'}) "
                     f"at {p.utilisation:.0%} of the card's bf16 peak: {s['why']}")
    else:
        lines.append(f"  speed     {s['clip_s']:.1f} s per {s['video_s_per_clip']:g} s clip "
                     f"({s['seconds_per_video_second']:.1f} s per second of video) at {p.utilisation:.0%} of the "
                     f"card's bf16 peak: {s['why']}")
    lines.append(f"            a forward: {s['forward']}")
    if "sr" in s:
        lines.append(f"            super-resolution: {s['sr']}")
    lines.extend(f"  note: {n}" for n in p.notes)
    lines.append("  fits" if p.fits else "  DOES NOT FIT")
    return "\n".join(lines)

