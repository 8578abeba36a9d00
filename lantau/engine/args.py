"""User-facing engine arguments to the frozen EngineConfig, without torch: the server's frontend
builds its config here and never imports torch. A device, dtype or attention backend left
"auto" is chosen by the engine core (`EngineCore` resolves it where torch is loaded)."""

from __future__ import annotations

import dataclasses
import enum

from lantau import envs
from lantau.config import CacheConfig, EngineConfig, KernelConfig, SchedulerConfig
from lantau.model.lora import parse_lora_modules
from lantau.model.manifest import Manifest, read_manifest
from lantau.model.source import ModelSource, read_model_config, resolve_model_source

# "fp8": bfloat16 activations, e4m3 weights in every decoder linear layer
# (ModelConfig.quantization)
DTYPES = ("auto", "float32", "float16", "bfloat16", "fp8")


def dtype_name(dtype) -> str:
    """A dtype's name; `dtype` is a name or a torch.dtype (named without importing torch)."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    return name


def build_engine_config(
    model: str | None = None,
    *,
    dtype="auto",
    device: str = "auto",
    max_model_len: int | None = None,
    tensor_parallel_size: int | None = None,
    seed: int = 0,
    block_size: int = 16,
    num_kv_blocks: int | None = None,
    gpu_memory_utilization: float = 0.90,
    enable_prefix_caching: bool = True,
    kv_cache_dtype: str = "auto",
    max_num_seqs: int = 256,
    max_num_batched_tokens: int | None = None,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    scheduling_policy: str = "max_utilization",
    attention_backend: str = "auto",
    enforce_eager: bool = False,
    async_scheduling: bool = True,
    kernels: KernelConfig | dict | None = None,
    lora_modules=(),
    max_loras: int = 0,
    max_lora_rank: int = 0,
) -> tuple[EngineConfig, ModelSource]:
    """The frozen EngineConfig and the model source, from user-facing arguments. `kernels`:
    the triton backend's choices (default: KernelConfig's, PDL as LANTAU_PDL says), or a
    dict of its fields (JSON's: lists read as tuples);
    `kv_cache_dtype`: "auto" (the model's dtype) or "fp8" (e4m3, twice the tokens)."""
    if max_loras < 0 or max_lora_rank < 0:
        raise ValueError("max_loras and max_lora_rank: at least 0")
    source = resolve_model_source(model)
    # an engine folder's manifest, read once: its model, its ranks and its dtype
    manifest = read_manifest(source.path) if source.kind == "engine" else None
    model_config = manifest.model_config if manifest else read_model_config(source)
    tensor_parallel_size = ranks_for(source.name, manifest, tensor_parallel_size)
    if tensor_parallel_size > 1:
        model_config.check_split(tensor_parallel_size)
    if manifest is not None:
        dtype = engine_folder_dtype(source.name, manifest, dtype_name(dtype))
    max_len = min(max_model_len or model_config.max_position_embeddings, 1 << 20)
    if max_len > model_config.max_position_embeddings:
        raise ValueError(
            f"max_model_len: {max_len} exceeds the model's "
            f"{model_config.max_position_embeddings} positions"
        )
    if attention_backend == "auto" and device != "auto":
        attention_backend = "triton" if device.startswith("cuda") else "torch"
    if max_num_batched_tokens is None:
        max_num_batched_tokens = 4096 if enable_chunked_prefill else max_len
    dtype = dtype_name(dtype)
    # "auto": the checkpoint's own (an FP8 checkpoint runs in fp8); a wide dtype dequantizes
    quantization = {"fp8": "fp8", "auto": model_config.quantization}.get(dtype)
    if quantization is not None:
        dtype = "bfloat16"  # _scaled_mm's row-wise scaling writes bf16
    config = EngineConfig(
        model=source.name,
        model_config=dataclasses.replace(model_config, quantization=quantization),
        dtype=resolve_dtype(dtype, device),
        device=device,
        seed=seed,
        tensor_parallel_size=tensor_parallel_size,
        attention_backend=attention_backend,
        enforce_eager=enforce_eager,
        async_scheduling=async_scheduling,
        kernels=kernel_config(kernels),
        lora_modules=parse_lora_modules(lora_modules),
        max_loras=max_loras,
        max_lora_rank=max_lora_rank,
        cache=CacheConfig(
            block_size=block_size,
            num_blocks=num_kv_blocks,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching,
            kv_cache_dtype=kv_cache_dtype,
        ),
        scheduler=SchedulerConfig(
            max_model_len=max_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            long_prefill_token_threshold=long_prefill_token_threshold,
            policy=scheduling_policy,
        ),
    )
    return config, source


def ranks_for(name: str, manifest: Manifest | None, asked: int | None) -> int:
    """The tensor-parallel size: what was asked (None: an engine folder's own, else 1); an
    engine folder (its manifest given) runs on the ranks it was built for, another size is an
    error saying what to do."""
    if asked is not None and asked < 1:
        raise ValueError("tensor_parallel_size: at least 1")
    if manifest is None:
        return asked or 1
    built = manifest.tensor_parallel_size
    if asked not in (None, built):
        raise ValueError(
            f"tensor_parallel_size: {name} was built for {built} rank(s); serve it with "
            f"--tensor-parallel-size {built}, or rebuild it with `lantau build "
            f"{manifest.source} --tensor-parallel-size {asked}`"
        )
    return built


def engine_folder_dtype(name: str, manifest: Manifest, dtype: str) -> str:
    """An engine folder runs in the dtype it was built in: "auto" is that one, another is
    an error saying what to do."""
    built = manifest.dtype
    if dtype not in ("auto", built):
        raise ValueError(
            f"dtype: {name} was built as {built}; serve it with --dtype auto (or "
            f"{built}), or rebuild it with `lantau build --dtype`"
        )
    return built


def resolve_dtype(dtype: str, device: str) -> str:
    """The dtype for a device: "auto" is bfloat16 on CUDA, float32 on CPU (and stays "auto"
    while the device does)."""
    if dtype != "auto" or device == "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"


def resolve_device(config: EngineConfig, cuda_available: bool) -> EngineConfig:
    """The config with "auto" device, dtype and attention backend chosen (a new object)."""
    device = config.device
    if device == "auto":
        device = "cuda" if cuda_available else "cpu"
    backend = config.attention_backend
    if backend == "auto":
        backend = "triton" if device.startswith("cuda") else "torch"
    return dataclasses.replace(
        config,
        device=device,
        dtype=resolve_dtype(config.dtype, device),
        attention_backend=backend,
    )


def kernel_config(kernels: KernelConfig | dict | None) -> KernelConfig:
    """A KernelConfig from itself, a dict of its fields (as JSON gives them: lists become
    tuples; PDL as LANTAU_PDL says unless given) or None (the defaults)."""
    if isinstance(kernels, KernelConfig):
        return kernels
    fields = {"enable_pdl": envs.pdl_enabled(), **(kernels or {})}
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(KernelConfig)})
    if unknown:
        raise ValueError(f"kernels: unknown field(s) {', '.join(unknown)}")

    defaults = KernelConfig()

    def as_tuples(value):
        return tuple(as_tuples(v) for v in value) if isinstance(value, list) else value

    def frozen(name: str, value):
        default = getattr(defaults, name)
        if isinstance(default, enum.Enum) and not isinstance(value, enum.Enum):
            return type(default)(value)  # AttnMerge by its value
        return as_tuples(value)

    return KernelConfig(**{name: frozen(name, value) for name, value in fields.items()})
