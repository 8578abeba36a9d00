"""How a model is built from its source (lantau.model.source: HF folder, GGUF file, random)."""

from __future__ import annotations

import contextlib
import threading
import time

import torch

from lantau.config import KernelConfig, ModelConfig
from lantau.model import fp8, hf_loader
from lantau.model.llama import LlamaForCausalLM
from lantau.model.parallel import SINGLE, TensorParallel
from lantau.model.source import (  # noqa: F401 - re-exported: where a model comes from
    DEFAULT_MODEL_FILE,
    ModelSource,
    default_model_path,
    load_tokenizer,
    read_model_config,
    resolve_model_source,
)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


_INITS = ("kaiming_uniform_", "uniform_", "normal_")  # what nn.Linear and nn.Embedding call


@contextlib.contextmanager
def _no_init():
    """nn.Linear and nn.Embedding leave their parameters as allocated: build_model sets every
    one next (load_weights and the engine loader refuse a missing one; init_random_weights
    draws them all), so their own random init is wasted work."""
    saved = {name: getattr(torch.nn.init, name) for name in _INITS}
    for name in _INITS:
        setattr(torch.nn.init, name, _keep)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def _keep(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


def build_model(
    source: ModelSource,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    ops: str = "torch",
    max_positions: int = 0,
    kernels: KernelConfig | None = None,
    *,
    load: bool = True,
    tp: TensorParallel = SINGLE,
    lora_modules: tuple[tuple[str, str], ...] = (),
    max_loras: int = 0,
    max_lora_rank: int = 0,
) -> LlamaForCausalLM:
    """The model on `device` in `dtype`, with its weights (random ones drawn there). With
    config.quantization "fp8" the decoder's linear layers are allocated in e4m3 and each
    weight is quantized on the device as it is drawn or read: no wide copy of them exists.
    `load=False`: the parameters left unset, for load_in_background. `tp`: this rank's slice
    of the model (lantau/model/parallel.py). `lora_modules`: (name, PEFT folder) adapters
    attached beside the weights, in `max_loras` slots (or one each) of rank up to
    `max_lora_rank` (or theirs): `model.adapter_slots`."""
    if config.quantization == "fp8":
        fp8.check_device(device)
    with torch.device(device), _default_dtype(dtype), _no_init():
        model = LlamaForCausalLM(config, ops, max_positions, kernels, tp)
    model.eval()
    from lantau.model.lora import attach_adapters, read_adapter

    adapters = [read_adapter(name, path, config) for name, path in lora_modules]
    model.adapter_slots = attach_adapters(model, adapters, max_loras, max_lora_rank)
    if not load:
        return model
    if source.kind == "random":
        model.init_random_weights(seed)
    elif source.kind == "engine":
        from lantau.model.engine_loader import load_engine_weights
        from lantau.model.manifest import read_manifest

        load_engine_weights(model, source.path, read_manifest(source.path))
    elif source.kind == "hf":
        model.load_weights(hf_loader.iter_hf_weights(source.path))
    else:
        from lantau.model import gguf_loader

        model.load_weights(gguf_loader.iter_gguf_weights(source.path, config))
    return model


class PendingWeights:
    """An engine folder's weights loading on a thread (load_in_background).

    NOTE: a daemon thread, not a ThreadPoolExecutor's (those are joined at exit): a core that
    fails while its weights load exits at once."""

    def __init__(self, load) -> None:
        self.seconds = 0.0  # from the load's start here to its end, once done
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._started = time.perf_counter()
        threading.Thread(target=self._run, args=(load,), name="lantau-load", daemon=True).start()

    def _run(self, load) -> None:
        try:
            load()
        except BaseException as e:  # re-raised by wait(), in the engine's own thread
            self._error = e
        finally:
            self.seconds = time.perf_counter() - self._started
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error


# reading threads of a load beside the CUDA graphs' capture: on 16 (min(jobs, CPUs, 16) on an
# H100 host) the capture took 9.4-10.2 s and the weights 7.7-7.8 s; on 4, 7.9-8.1 s and 7.4 s,
# and `lantau serve --model-repository` of an 8B engine folder was ready in 19.56 s against
# 20.73 (median of 2, cold page cache, H100, RESULTS.md 2026-12-06)
BACKGROUND_LOAD_THREADS = 4


def load_in_background(
    model: LlamaForCausalLM, source: ModelSource, zero: bool = False
) -> PendingWeights:
    """An engine folder's weights loading into `model` (built with load=False) on
    BACKGROUND_LOAD_THREADS threads: meanwhile the caller may run what needs the parameters'
    memory but not their values (CUDA graph capture, a warm-up), and must wait for it before
    anything whose results matter. `zero`: the tensors zeroed first, for a caller that runs
    the model before the load ends (a warm-up): it reads zeros or loaded values, never NaN or
    inf from stale bytes. (A GPU's memset; on CPU a first touch of every page, seconds for a
    few GB on a small VM, which the load's own threads otherwise pay as they read.)"""
    from lantau.model.engine_loader import engine_tensors, load_engine_weights
    from lantau.model.manifest import read_manifest

    if source.kind != "engine":
        raise ValueError(f"only an engine folder loads in the background, not {source.kind!r}")
    manifest = read_manifest(source.path)
    if zero:
        with torch.no_grad():
            for tensor in engine_tensors(model).values():
                tensor.zero_()
    device = model.lm_head.weight.device
    if device.type == "cuda":  # the construction's kernels end before copies land
        torch.cuda.synchronize(device)
    return PendingWeights(
        lambda: load_engine_weights(
            model, source.path, manifest, synchronize=False, num_threads=BACKGROUND_LOAD_THREADS
        )
    )
