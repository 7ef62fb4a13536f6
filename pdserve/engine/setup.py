"""Start-up pieces of the policies that split the GPU: SM partitions and the latency model,
loud when the GPU cannot give what was asked (no silent fallback)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pdserve.config import EngineConfig, mux_sharing_options
from pdserve.engine.streams import StreamOps
from pdserve.gpu.driver import EmulatedDriver
from pdserve.gpu.partitions import Partition, PartitionSet
from pdserve.sched.mux_planner import profile_groups
from pdserve.sched.predictor import LatencyPredictor, predictor_path, require_coverage
from pdserve.sched.roofline import GpuCost, ModelCost, RooflinePredictor

log = logging.getLogger(__name__)


def parse_ints(text: str) -> list[int]:
    return sorted({int(part) for part in str(text).replace(" ", "").split(",") if part})


class PartitionError(RuntimeError):
    """The GPU cannot be split as the schedule needs (and emulation was not allowed)."""


@dataclass
class EngineSetup:
    """What a caller may hand the engine instead of building it (tests: fake streams and
    drivers, a chosen latency model; benchmarks: a freshly profiled predictor)."""

    partitions: PartitionSet | None = None
    disagg_partition: Partition | None = None
    predictor: object = None
    ops: StreamOps | None = None


def build_partitions(config: EngineConfig, device: torch.device) -> PartitionSet:
    """Green-context partitions on a GPU, nominal ones on the CPU, so the planner and the
    engine run the same way everywhere. On a GPU where green contexts cannot be made this
    stops with the driver's reason unless ``allow_emulated_partitions`` is set."""
    options = parse_ints(config.scheduler.mux_decode_sms)
    if device.type != "cuda":
        return PartitionSet.build(EmulatedDriver(), options)
    pset = PartitionSet.for_device(str(device) if device.index is not None else "cuda",
                                   options)
    why = pset.emulation_reason if pset.emulated else _streams_fail(pset, device)
    if why is None:
        return pset
    if not config.device.allow_emulated_partitions:
        raise PartitionError(f"--schedule {config.scheduler.schedule} needs green-context SM "
                             f"partitions, which this GPU cannot give: {why} "
                             "(--allow-emulated-partitions runs without a real split)")
    log.warning("SM partitions EMULATED (no real split): %s", why)
    driver = EmulatedDriver(num_sms=pset.total_sms, granule=pset.granularity)
    return PartitionSet.build(driver, options)


def _streams_fail(pset: PartitionSet, device: torch.device) -> str | None:
    """Why the partition streams cannot run work (a kernel, an event and a cross-stream
    wait on every one), or None when they can."""
    try:
        probe = torch.ones(1024, device=device)
        for part in pset.choices():
            with torch.cuda.stream(part.decode_stream):
                probe.mul_(1.0)
                event = torch.cuda.Event()
                event.record(part.decode_stream)
            part.prefill_stream.wait_event(event)
            with torch.cuda.stream(part.prefill_stream):
                probe.add_(0.0)
            part.prefill_stream.synchronize()
        torch.cuda.synchronize(device)
        return None
    except Exception as exc:  # a driver or binding that splits but cannot run work
        return f"green-context streams failed a self-test: {exc}"


def default_profile_dir() -> Path:
    env = os.environ.get("PDSERVE_PROFILE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "pdserve" / "profiles"


def gpu_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    return torch.cuda.get_device_name(device)


def model_key(config: EngineConfig) -> str:
    """Presets by name, checkpoints by folder name: what a profile is saved under. A
    tensor-parallel group times its own shard and collectives: its size is in the key."""
    name = Path(str(config.model.model).rstrip("/")).name or str(config.model.model)
    size = config.device.tensor_parallel_size
    return name if size == 1 else f"{name}-tp{size}"


def profile_path(config: EngineConfig, device: torch.device) -> Path:
    given = config.scheduler.mux_predictor
    if given and Path(given).suffix == ".json":
        return Path(given)
    folder = Path(given) if given else default_profile_dir()
    return predictor_path(folder, gpu_name(device), model_key(config))


class PredictorError(RuntimeError):
    """No latency profile fits this GPU and model (and the roofline was not asked for)."""


def load_predictor(config: EngineConfig, runner, partitions: PartitionSet
                   ) -> tuple[object, dict]:
    """(latency model, where it came from): the saved profile of this (GPU, model); the
    roofline model only when asked for (``--mux-predictor roofline``) or on the CPU, where
    no profile means anything. A fitted profile must have timed every group the planner can
    ask about (``profile_groups``) unless ``mux_allow_unprofiled``."""
    total_sms = partitions.total_sms
    # One rank's shapes: under tensor parallelism each GPU runs its shard (collectives are
    # not in the roofline).
    roofline = roofline_for(runner.model.arch, total_sms, runner.dtype.itemsize)
    if config.scheduler.mux_predictor == "roofline":
        log.info("multiplex: roofline latency model (asked for)")
        return roofline, {"kind": "roofline", "why": "asked for"}
    path = profile_path(config, runner.device)
    try:
        fitted, held_out = _read_profile(path, runner.model.num_layers, total_sms)
    except ValueError as exc:
        if runner.device.type == "cuda":
            raise PredictorError(f"{exc}; run `pdserve profile` for this GPU and model, or "
                                 "ask for --mux-predictor roofline") from None
        log.info("multiplex: %s; roofline latency model on the CPU", exc)
        return roofline, {"kind": "roofline", "why": str(exc)}
    log.info("multiplex: latency predictor from %s", path)
    spatial = "spatial" in mux_sharing_options(config.scheduler.mux_sharing)
    groups = profile_groups(partitions.decode_sm_choices() if spatial else [], total_sms)
    fallback = roofline if config.scheduler.mux_allow_unprofiled else None
    predictor = require_coverage(fitted, groups, fallback)
    missing = sorted(getattr(predictor, "missing", ()))
    return predictor, {"kind": "fitted", "path": str(path), "held_out": held_out,
                       "roofline_for_unprofiled": missing}


def _read_profile(path: Path, num_layers: int, total_sms: int
                  ) -> tuple[LatencyPredictor, dict | None]:
    """The profile's predictor and held-out error, read once; ValueError says why not."""
    if not path.exists():
        raise ValueError(f"no latency profile at {path}")
    try:
        held_out = json.loads(path.read_text()).get("held_out")
        pred = LatencyPredictor.load(path)
    except Exception as exc:
        raise ValueError(f"the latency profile {path} cannot be read: {exc}") from None
    if pred.num_layers != num_layers or pred.total_sms != total_sms:
        raise ValueError(f"{path} was fitted for {pred.num_layers} layers / {pred.total_sms} "
                         f"SMs, not {num_layers} / {total_sms}")
    return pred, held_out


def policy_args(config: EngineConfig, runner, setup: EngineSetup) -> dict:
    """What the schedule's policy needs beyond its pool: partitions and a latency model."""
    schedule = config.scheduler.schedule
    if schedule == "multiplex":
        partitions = setup.partitions or build_partitions(config, runner.device)
        if setup.predictor is not None:
            predictor, source = setup.predictor, {"kind": "given", "type":
                                                  type(setup.predictor).__name__}
        else:
            predictor, source = load_predictor(config, runner, partitions)
        return {"partitions": partitions, "predictor": predictor, "predictor_source": source,
                "num_layers": runner.model.num_layers}
    if schedule == "disagg":
        return {"partition": setup.disagg_partition or build_disagg_partition(config,
                                                                              runner.device)}
    return {}


DEFAULT_DECODE_SHARE = 0.4  # of the SMs; decode is bandwidth-bound and needs fewer


def build_disagg_partition(config: EngineConfig, device: torch.device) -> Partition:
    """The one fixed split of disaggregation, at the driver's granularity."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        total = EmulatedDriver.num_sms
    decode = config.scheduler.disagg_decode_sms or max(1, round(DEFAULT_DECODE_SHARE * total))
    sched = replace(config.scheduler, mux_decode_sms=str(decode))
    choices = build_partitions(replace(config, scheduler=sched), device).choices()
    if not choices:
        raise PartitionError(f"cannot split {total} SMs with {decode} for decode")
    return choices[0]


def roofline_for(arch, total_sms: int, dtype_bytes: int = 2) -> RooflinePredictor:
    cost = ModelCost.llama(arch.num_layers, arch.hidden_size, arch.num_kv_heads * arch.head_dim,
                           arch.intermediate_size, arch.vocab_size, dtype_bytes)
    return RooflinePredictor(cost, GpuCost(total_sms=total_sms))
