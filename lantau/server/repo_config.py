"""A repository model's `config.pbtxt` (Triton's text format, parsed with protobuf's
text_format into Triton's own ModelConfig message) mapped onto lantau's iteration-level
scheduler. docs/model-repository.md explains every field: what it maps to, or why it is
ignored. A field lantau cannot honour is an error naming it, never silently dropped."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

CONFIG_NAME = "config.pbtxt"

# top-level fields accepted and ignored (docs/model-repository.md says why)
IGNORED_FIELDS = frozenset(
    {
        "platform",  # the engine folder says what runs
        "backend",
        "runtime",
        "input",  # lantau's tensors are TensorRT-LLM's names, fixed
        "output",
        "optimization",  # CUDA graphs and kernels are lantau's own
        "model_warmup",  # lantau warms up every version, then sends a canary request
        "default_model_filename",
        "cc_model_filenames",
        "metric_tags",
        "model_metrics",
    }
)
MAPPED_FIELDS = frozenset(
    {
        "name",
        "version_policy",
        "max_batch_size",
        "instance_group",
        "dynamic_batching",
        "parameters",
        "model_transaction_policy",
    }
)
# dynamic_batching's fields lantau takes (the rest are errors)
DYNAMIC_BATCHING_FIELDS = frozenset(
    {
        "preferred_batch_size",
        "max_queue_delay_microseconds",
        "preserve_ordering",
        "priority_levels",
        "default_priority_level",
        "default_queue_policy",
    }
)
INSTANCE_GROUP_FIELDS = frozenset({"name", "kind", "count", "gpus"})
SWAP_MODES = ("side_by_side", "drain_first")


class ModelConfigError(ValueError):
    """A config.pbtxt lantau cannot serve; `field` names the culprit."""

    def __init__(self, path: Path | str, field: str, message: str) -> None:
        super().__init__(f"{path}: {field}: {message}")
        self.field = field


@dataclass(frozen=True)
class VersionPolicy:
    kind: str = "latest"  # "latest" | "all" | "specific"
    num_versions: int = 1  # latest
    versions: tuple[int, ...] = ()  # specific

    def select(self, available: list[int]) -> list[int]:
        """The versions to serve among those present (complete), newest first."""
        ordered = sorted(available, reverse=True)
        if self.kind == "all":
            return ordered
        if self.kind == "specific":
            return [v for v in ordered if v in self.versions]
        return ordered[: self.num_versions]


@dataclass(frozen=True)
class CanaryPolicy:
    """After a swap, the new version takes `share` of the traffic until it has served
    `num_requests` (or `window_s` passed); it is rolled back if its P95 latency passes
    `p95_ratio` times the previous version's over the same window, or its error rate passes
    `max_error_rate`. share 0: no canary phase, traffic moves at once."""

    share: float = 0.0
    num_requests: int = 20
    window_s: float = 300.0
    p95_ratio: float = 2.0
    max_error_rate: float = 0.05


@dataclass(frozen=True)
class RepoModelConfig:
    name: str
    version_policy: VersionPolicy = VersionPolicy()
    max_num_seqs: int | None = None  # max_batch_size (None: lantau's default)
    device: str = "auto"  # instance_group kind: KIND_CPU -> "cpu"
    num_replicas: int = 1  # instance_group count x gpus (one served; see the docs)
    max_pending_requests: int | None = None  # dynamic_batching.default_queue_policy
    default_priority: int = 0
    engine_args: dict = field(default_factory=dict)  # from parameters
    swap: str = "side_by_side"  # "drain_first": the old version stops before the new loads
    warmup_canary: bool = True  # one request through a new version before it takes traffic
    canary: CanaryPolicy = CanaryPolicy()
    ignored: tuple[str, ...] = ()  # fields given and ignored (logged once)
    # the file's fields as Triton's model-config JSON shows them (what get_model_config returns)
    given: dict = field(default_factory=dict)


def parse_config_text(text: str, path: Path | str, folder_name: str) -> RepoModelConfig:
    msg = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(text, msg)
    except text_format.ParseError as e:  # names the field: 'has no field named "foo"'
        raise ModelConfigError(path, f"line {e.GetLine()}", str(e).split(" : ", 1)[-1]) from None
    given = {f.name for f, _ in msg.ListFields()}
    for name in sorted(given - MAPPED_FIELDS - IGNORED_FIELDS):
        raise ModelConfigError(path, name, "not supported by lantau (docs/model-repository.md)")
    if msg.name and msg.name != folder_name:
        message = f"{msg.name!r} differs from its folder {folder_name!r}"
        raise ModelConfigError(path, "name", message)
    if msg.max_batch_size < 0:
        raise ModelConfigError(path, "max_batch_size", "must be >= 0")
    device, num_replicas = _instance_groups(msg, path)
    max_pending, default_priority = _dynamic_batching(msg, path)
    params = _parameters(msg, path)
    return RepoModelConfig(
        name=folder_name,
        version_policy=_version_policy(msg, path),
        max_num_seqs=msg.max_batch_size or None,
        device=device,
        num_replicas=num_replicas,
        max_pending_requests=max_pending,
        default_priority=default_priority,
        ignored=tuple(sorted(given & IGNORED_FIELDS)),
        given=json_format.MessageToDict(msg, preserving_proto_field_name=True),
        **params,
    )


def read_model_config(model_dir: Path) -> RepoModelConfig:
    """REPO/NAME/config.pbtxt, or the defaults when the folder has none (as Triton's
    auto-complete would)."""
    path = model_dir / CONFIG_NAME
    if not path.exists():
        return RepoModelConfig(name=model_dir.name)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ModelConfigError(path, "file", f"unreadable: {e}") from None
    return parse_config_text(text, path, model_dir.name)


def _version_policy(msg, path) -> VersionPolicy:
    if not msg.HasField("version_policy"):
        return VersionPolicy()
    which = msg.version_policy.WhichOneof("policy_choice")
    if which == "all":
        return VersionPolicy("all")
    if which == "specific":
        versions = tuple(msg.version_policy.specific.versions)
        if not versions or min(versions) < 1:
            raise ModelConfigError(path, "version_policy.specific.versions", "versions >= 1")
        return VersionPolicy("specific", versions=versions)
    num = msg.version_policy.latest.num_versions if which == "latest" else 1
    if num < 1:
        raise ModelConfigError(path, "version_policy.latest.num_versions", "must be >= 1")
    return VersionPolicy("latest", num_versions=num)


def _instance_groups(msg, path) -> tuple[str, int]:
    kinds = model_config_pb2.ModelInstanceGroup.Kind
    device, num_replicas = "auto", 0
    for i, group in enumerate(msg.instance_group):
        where = f"instance_group[{i}]"
        for f, _ in group.ListFields():
            if f.name not in INSTANCE_GROUP_FIELDS:
                raise ModelConfigError(path, f"{where}.{f.name}", "not supported by lantau")
        if group.count < 0:
            raise ModelConfigError(path, f"{where}.count", "must be >= 0")
        if group.kind == kinds.Value("KIND_MODEL"):
            raise ModelConfigError(path, f"{where}.kind", "KIND_MODEL is not supported")
        if group.kind == kinds.Value("KIND_CPU"):
            device = "cpu"
            if group.gpus:
                raise ModelConfigError(path, f"{where}.gpus", "KIND_CPU takes no gpus")
        if any(g < 0 for g in group.gpus):
            raise ModelConfigError(path, f"{where}.gpus", "GPU indices are >= 0")
        num_replicas += max(group.count, 1) * max(len(group.gpus), 1)
    return device, max(num_replicas, 1)


def _dynamic_batching(msg, path) -> tuple[int | None, int]:
    if not msg.HasField("dynamic_batching"):
        return None, 0
    db = msg.dynamic_batching
    for f, _ in db.ListFields():
        if f.name not in DYNAMIC_BATCHING_FIELDS:
            raise ModelConfigError(path, f"dynamic_batching.{f.name}", "not supported by lantau")
    for size in db.preferred_batch_size:
        if size < 1 or (msg.max_batch_size and size > msg.max_batch_size):
            raise ModelConfigError(
                path,
                "dynamic_batching.preferred_batch_size",
                f"{size} is not within 1..max_batch_size ({msg.max_batch_size})",
            )
    if db.priority_levels and not 0 <= db.default_priority_level <= db.priority_levels:
        raise ModelConfigError(
            path, "dynamic_batching.default_priority_level", "must be within 0..priority_levels"
        )
    policy = db.default_queue_policy
    return (policy.max_queue_size or None), db.default_priority_level


# parameters { key: "NAME" value: { string_value: "..." } } lantau reads, with their parsers
def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise ValueError(f"must be >= {minimum}")
        return value

    return parse


_positive_int, _count = _int_at_least(1), _int_at_least(0)


def _share(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise ValueError("must be within 0..1")
    return value


def _ratio(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("must be > 0")
    return value


def _bool(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0"):
        raise ValueError("expected true or false")
    return text.lower() in ("true", "1")


def _swap(text: str) -> str:
    if text not in SWAP_MODES:
        raise ValueError(f"expected one of {', '.join(SWAP_MODES)}")
    return text


def _dtype(text: str) -> str:
    if text not in ("auto", "float32", "float16", "bfloat16"):
        raise ValueError("expected auto, float32, float16 or bfloat16")
    return text


def _memory_share(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise ValueError("must be within (0, 1]")
    return value


def _kv_cache_dtype(text: str) -> str:
    if text not in ("auto", "fp8"):
        raise ValueError("expected auto or fp8")
    return text


def _lora_modules(text: str, model_dir: Path) -> tuple[str, ...]:
    """The model's LoRA adapters (PEFT folders), "NAME=PATH,NAME=PATH", a PATH relative to
    the model's folder (REPO/NAME) or absolute: NAME=ABSOLUTE_PATH each, as the engine takes
    them."""
    from lantau.model.lora import parse_lora_modules

    modules = parse_lora_modules([s.strip() for s in text.split(",") if s.strip()])
    if not modules:
        raise ValueError("expected NAME=PATH[,NAME=PATH...]")
    specs = []
    for name, path in modules:
        folder = model_dir / path  # an absolute path stays as it is
        if not (folder / "adapter_config.json").is_file():
            raise ValueError(f"{name}: {folder} is not a PEFT adapter folder (adapter_config.json)")
        specs.append(f"{name}={folder.resolve()}")
    return tuple(specs)


ENGINE_PARAMETERS = {
    "max_model_len": _positive_int,
    "num_kv_blocks": _positive_int,
    "max_num_batched_tokens": _positive_int,
    "dtype": _dtype,
    "kv_cache_dtype": _kv_cache_dtype,
    "gpu_memory_utilization": _memory_share,
    "enable_prefix_caching": _bool,
    "enforce_eager": _bool,
    "max_loras": _count,
    "max_lora_rank": _count,
}
CONTROL_PARAMETERS = {
    "swap": _swap,
    "warmup_canary": _bool,
    "canary_share": _share,
    "canary_requests": _positive_int,
    "canary_window_s": _ratio,
    "canary_p95_ratio": _ratio,
    "canary_max_error_rate": _share,
}


def _parameters(msg, path) -> dict:
    engine_args, control = {}, {}
    for key, param in msg.parameters.items():
        where = f"parameters[{key!r}]"
        parse = ENGINE_PARAMETERS.get(key) or CONTROL_PARAMETERS.get(key)
        if key == "lora_modules":  # paths relative to the model's folder
            parse = functools.partial(_lora_modules, model_dir=Path(path).parent)
        if parse is None:
            known = ", ".join([*ENGINE_PARAMETERS, "lora_modules", *CONTROL_PARAMETERS])
            raise ModelConfigError(path, where, f"unknown parameter (lantau reads {known})")
        try:
            value = parse(param.string_value)
        except ValueError as e:
            raise ModelConfigError(path, where, f"{param.string_value!r}: {e}") from None
        (control if key in CONTROL_PARAMETERS else engine_args)[key] = value
    canary = CanaryPolicy(
        share=control.get("canary_share", 0.0),
        num_requests=control.get("canary_requests", 20),
        window_s=control.get("canary_window_s", 300.0),
        p95_ratio=control.get("canary_p95_ratio", 2.0),
        max_error_rate=control.get("canary_max_error_rate", 0.05),
    )
    return dict(
        engine_args=engine_args,
        swap=control.get("swap", "side_by_side"),
        warmup_canary=control.get("warmup_canary", True),
        canary=canary,
    )
