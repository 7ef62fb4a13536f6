"""Start-up pieces of the multiplex engine: partitions, graph buckets, the latency model."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from pdserve.config import EngineConfig
from pdserve.gpu.driver import EmulatedDriver
from pdserve.gpu.partitions import PartitionSet
from pdserve.sched.predictor import LatencyPredictor, predictor_path
from pdserve.sched.roofline import GpuCost, ModelCost, RooflinePredictor

log = logging.getLogger(__name__)


def parse_ints(text: str) -> list[int]:
    return sorted({int(part) for part in str(text).replace(" ", "").split(",") if part})


def build_partitions(config: EngineConfig, device: torch.device) -> PartitionSet:
    """Green-context partitions on a GPU (emulated where they do not work), nominal ones on
    the CPU, so the planner and the loop run the same way everywhere."""
    options = parse_ints(config.scheduler.mux_decode_sms)
    if device.type != "cuda":
        return PartitionSet.build(EmulatedDriver(), options)
    pset = PartitionSet.for_device(str(device) if device.index is not None else "cuda",
                                   options)
    if not pset.emulated and not _streams_work(pset, device):
        log.warning("green-context streams failed a self-test; partitions emulated")
        driver = EmulatedDriver(num_sms=pset.total_sms, granule=pset.granularity)
        pset = PartitionSet.build(driver, options)
    return pset


def _streams_work(pset: PartitionSet, device: torch.device) -> bool:
    """A kernel, an event and a cross-stream wait on every partition stream."""
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
        return True
    except Exception as exc:  # a driver or binding that splits but cannot run work
        log.warning("partition stream self-test: %s", exc)
        return False


def graph_buckets(config: EngineConfig) -> list[int]:
    if config.device.enforce_eager:
        return []
    most = min(config.device.cuda_graph_max_batch, config.scheduler.max_num_seqs)
    buckets = [b for b in parse_ints(config.scheduler.mux_graph_batches) if b <= most]
    return sorted(set(buckets) | {most}) if buckets else [most]


def default_profile_dir() -> Path:
    env = os.environ.get("PDSERVE_PROFILE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "pdserve" / "profiles"


def gpu_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    return torch.cuda.get_device_name(device)


def model_key(config: EngineConfig) -> str:
    """Presets by name, checkpoints by folder name: what a profile is saved under."""
    return Path(str(config.model.model).rstrip("/")).name or str(config.model.model)


def profile_path(config: EngineConfig, device: torch.device) -> Path:
    given = config.scheduler.mux_predictor
    if given and Path(given).suffix == ".json":
        return Path(given)
    folder = Path(given) if given else default_profile_dir()
    return predictor_path(folder, gpu_name(device), model_key(config))


def load_predictor(config: EngineConfig, runner, total_sms: int):
    """The saved profile of this (GPU, model) if there is one, else a roofline model."""
    path = profile_path(config, runner.device)
    num_layers = runner.model.num_layers
    if path.exists():
        try:
            pred = LatencyPredictor.load(path)
            if pred.num_layers == num_layers and pred.total_sms == total_sms:
                log.info("multiplex: latency predictor from %s", path)
                return pred
            log.warning("%s was fitted for %d layers / %d SMs, not %d / %d; ignoring it",
                        path, pred.num_layers, pred.total_sms, num_layers, total_sms)
        except Exception as exc:
            log.warning("could not load the latency predictor %s: %s", path, exc)
    log.info("multiplex: no latency profile at %s; planning with the roofline model "
             "(run `pdserve profile` for a fitted one)", path)
    return roofline_for(runner.arch, total_sms, runner.dtype.itemsize)


def roofline_for(arch, total_sms: int, dtype_bytes: int = 2) -> RooflinePredictor:
    cost = ModelCost.llama(arch.num_layers, arch.hidden_size, arch.num_kv_heads * arch.head_dim,
                           arch.intermediate_size, arch.vocab_size, dtype_bytes)
    return RooflinePredictor(cost, GpuCost(total_sms=total_sms))
