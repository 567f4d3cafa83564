"""fla's autotuned kernels on stored configs: no benchmarking of candidates at start-up.

fla decorates its Triton kernels with its own autotuner (fla.ops.utils.cache.CachedAutotuner):
with fla's config cache on (its FLA_CACHE_MODE), a kernel first looks up the config stored for
its autotune key in `{FLA_CONFIG_DIR}/{kernel}.json` and autotunes only where none is stored.
Each candidate config is a separate Triton compile plus a benchmark, and fla's KDA kernels list
several candidates each: without a warm Triton cache, start-up compiles every one of them.

kdaserve stores the winners its own start-up picked, per GPU, in
`kernels/configs/fla/{device name}/` (fla's file format), and points fla there with the exact-key
mode (fla's "strict": a key not stored, another model's dims or dtypes, autotunes as before).
`dump_configs` writes the files from a process that has autotuned (benchmarks/first_steps.py
--dump-fla-configs), with the GPU's traits in `device.json` (compute capability, SM count). A
GPU without a folder of its own takes the files of a GPU with the same traits (the H200 the
H100's: one die, the same SMs, shared memory and registers; only the memory differs), as
stored choices rather than measured ones, until a run on it writes its own. A user's own
FLA_CACHE_MODE or FLA_CONFIG_DIR is left as it is: setting FLA_CACHE_MODE=disabled is the way
back to autotuning everything.
"""

from __future__ import annotations

import gc
import json
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

CONFIG_ROOT = Path(__file__).resolve().parent / "configs" / "fla"


def device_dir(device_name: str, root: Path = CONFIG_ROOT) -> Path:
    """The folder of one GPU's files, named as fla names its own (sanitize_gpu_name)."""
    from fla.ops.utils.cache import sanitize_gpu_name

    return root / sanitize_gpu_name(device_name)


DEVICE_FILE = "device.json"
"""A folder's GPU traits (device_traits), written by dump_configs; not a kernel's file."""


def device_traits(device) -> dict:
    """What fla's autotuned choices depend on besides the shapes: the compute capability (shared
    memory, registers, instructions) and the SM count (the grid's waves)."""
    import torch

    props = torch.cuda.get_device_properties(device)
    return {"capability": [props.major, props.minor],
            "multi_processor_count": props.multi_processor_count}


def _kernel_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.json") if p.name != DEVICE_FILE) \
        if folder.is_dir() else []


def _same_traits_folder(traits: dict, root: Path) -> Path | None:
    """A stored GPU folder under root whose device.json matches traits (the first by name)."""
    for folder in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        info = folder / DEVICE_FILE
        if info.is_file() and _kernel_files(folder):
            stored = json.loads(info.read_text())
            if all(stored.get(k) == v for k, v in traits.items()):
                return folder
    return None


def use_stored_configs(device_name: str, root: Path = CONFIG_ROOT,
                       traits: dict | None = None) -> Path | None:
    """Point fla's config cache at the stored configs of this GPU (exact autotune keys) unless
    the user set FLA_CACHE_MODE or FLA_CONFIG_DIR; a GPU without files of its own takes those of
    a GPU with the same traits (device_traits; none given: no fallback). Returns the folder in
    use, or None (no files, or the user's settings apply). Call it before the first fla kernel
    runs; it also takes effect if fla was imported earlier (fla reads its mode at import)."""
    folder = device_dir(device_name, root)
    if not _kernel_files(folder) and traits is not None:
        folder = _same_traits_folder(traits, root) or folder
    if (os.environ.get("FLA_CONFIG_DIR"), os.environ.get("FLA_CACHE_MODE")) == (str(folder),
                                                                                  "strict"):
        return folder                 # set by an earlier call in this process
    if "FLA_CACHE_MODE" in os.environ or "FLA_CONFIG_DIR" in os.environ:
        logger.info("fla configs: FLA_CACHE_MODE=%s FLA_CONFIG_DIR=%s as set by the user",
                    os.environ.get("FLA_CACHE_MODE"), os.environ.get("FLA_CONFIG_DIR"))
        return None
    files = _kernel_files(folder)
    if not files:
        logger.info("fla configs: none stored for %s; fla autotunes its kernels at start-up",
                    device_name)
        return None
    if folder != device_dir(device_name, root):
        logger.info("fla configs: none stored for %s; taking %s's (the same %s)", device_name,
                    folder.name, traits)
    os.environ["FLA_CONFIG_DIR"] = str(folder)
    os.environ["FLA_CACHE_MODE"] = "strict"
    from fla.ops.utils import cache as fla_cache

    fla_cache.FLA_CACHE_MODE = fla_cache.FlaCacheMode.STRICT
    logger.info("fla configs: %d kernels' stored configs from %s (keys not stored autotune)",
                len(files), folder)
    return folder


def tuned_autotuners() -> list:
    """fla's autotuners in this process that hold at least one chosen config."""
    from fla.ops.utils.cache import CachedAutotuner

    return [o for o in gc.get_objects() if isinstance(o, CachedAutotuner) and o.cache]


def config_entry(key: tuple, config) -> dict:
    """One autotune entry in fla's file format (fla.ops.utils.cache.KernelConfigFile)."""
    return {"autotune_key": list(key),
            "config": {"kwargs": dict(config.kwargs), "num_warps": config.num_warps,
                       "num_stages": config.num_stages, "num_ctas": config.num_ctas,
                       "maxnreg": config.maxnreg}}


def dump_configs(device_name: str, root: Path = CONFIG_ROOT, autotuners=None,
                 traits: dict | None = None) -> dict[str, int]:
    """Write every chosen config of this process's fla autotuners into the GPU's folder under
    root, merged into the files already there (an entry of the same key is replaced), and the
    GPU's traits (device_traits) into its device.json when given. Returns {kernel: entries
    written}."""
    import triton
    from fla.ops.utils.cache import AutotuneKey

    folder = device_dir(device_name, root)
    folder.mkdir(parents=True, exist_ok=True)
    if traits is not None:
        (folder / DEVICE_FILE).write_text(json.dumps(dict(name=device_name, **traits),
                                                     indent=1) + "\n")
    written: dict[str, int] = {}
    for tuner in tuned_autotuners() if autotuners is None else autotuners:
        path = folder / f"{tuner.kernel_name}.json"
        data = json.loads(path.read_text()) if path.is_file() else {}
        entries = data.get("autotune_entries") or {}
        for key, config in tuner.cache.items():
            entries[AutotuneKey.key_hash(key)] = config_entry(key, config)
        data.update(kernel_name=tuner.kernel_name, triton_version=triton.__version__,
                    autotune_entries=dict(sorted(entries.items())))
        path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        written[tuner.kernel_name] = written.get(tuner.kernel_name, 0) + len(tuner.cache)
    return written
