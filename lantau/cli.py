"""The `lantau` command: `chat` (a model in the terminal), `serve`, `build` (an engine
folder), `rollback` (a served model's version), `bench offline`,
`bench serve` and `bench sweep` (a load generator against a running server)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from lantau.config import KV_CACHE_DTYPES
from lantau.request import SamplingParams

# lantau serve's: an arriving prompt stalls the running streams for steps of at most this many
# tokens, which bounds their inter-token latency at a small cost in time to first token
# (RESULTS.md: W1-16-itl-p95); offline runs want whole prompts (0)
SERVE_LONG_PREFILL_TOKENS = 256
# lantau serve's batch limits: a burst of requests runs at once, its prompts in steps of up to
# 16k tokens (RESULTS.md: W1-inf); steady traffic's steps stay far below either
SERVE_MAX_NUM_SEQS = 512
# `lantau chat`'s sampling where neither its flags nor the model's generation config set it
CHAT_SAMPLING = {"temperature": 0.7, "top_p": 0.9, "max_tokens": 256}
SERVE_MAX_NUM_BATCHED_TOKENS = 16384


def _add_tls_args(p: argparse.ArgumentParser, where: str) -> None:
    p.add_argument("--ssl-keyfile", metavar="PEM", help=f"TLS on {where}: the key")
    p.add_argument("--ssl-certfile", metavar="PEM", help="TLS: the certificate (chain)")
    p.add_argument(
        "--ssl-ca-certs",
        metavar="PEM",
        help="mutual TLS: clients must present a certificate this CA signed",
    )


def _add_scheduling_args(p: argparse.ArgumentParser, long_prefill_tokens: int = 0) -> None:
    p.add_argument(
        "--scheduling-policy",
        default="max_utilization",
        choices=["max_utilization", "guaranteed_no_evict"],
        help="guaranteed_no_evict: admit only what can finish without preemption",
    )
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=long_prefill_tokens,
        help="longer prompts run in equal chunks of at most this many tokens a step, a chunk "
        "taking the padding of its step's CUDA graph besides (0: off)",
    )
    p.add_argument(
        "--no-async-scheduling",
        dest="async_scheduling",
        action="store_false",
        help="run steps one at a time instead of preparing step N+1 while step N runs",
    )


def _add_engine_args(p: argparse.ArgumentParser, eager: bool = True) -> None:
    """The engine's own flags, named as vLLM names them (`lantau serve`, `chat`, `bench
    offline`)."""
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.90,
        help="the share of the GPU's memory the engine may use: weights, activations and the "
        "KV cache, which takes what the rest leaves (CUDA; default 0.90)",
    )
    p.add_argument(
        "--seed", type=int, default=0,
        help="random weights' seed, and the sampler's for requests without their own",
    )  # fmt: skip
    if eager:
        p.add_argument(
            "--enforce-eager", action="store_true", help="no CUDA graphs: every step eager"
        )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of prompts' shared prefixes (default on)",
    )
    p.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split long prompts across steps (default on); off, a step's token budget is "
        "max_model_len unless --max-num-batched-tokens says otherwise",
    )


def _add_dtype_arg(p: argparse.ArgumentParser) -> None:
    from lantau.engine.args import DTYPES

    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="auto: bfloat16 on CUDA, float32 on CPU; fp8: e4m3 weights in every decoder "
        "linear layer, bfloat16 activations (CUDA: compute capability 8.9+)",
    )


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="HF folder, .gguf file or random:NAME")
    _add_dtype_arg(p)
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    _add_kv_cache_dtype_arg(p)
    _add_tensor_parallel_arg(p)


def _add_tensor_parallel_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=None,
        help="GPUs (ranks) each layer is split over, Megatron-style (docs/tensor-parallel.md); "
        "default 1, or what an engine folder was built for",
    )  # fmt: skip


def _add_kv_cache_dtype_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="auto: the model's dtype; fp8: e4m3 (twice the cached tokens, docs/fp8-kv.md)",
    )


def _add_observability_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--disable-metrics",
        dest="enable_metrics",
        action="store_false",
        help="no /metrics: nothing is timed or counted (to measure what metrics cost)",
    )
    p.add_argument(
        "--metrics-buckets",
        action="append",
        metavar="NAME=B1,B2,...",
        help="histogram bounds in seconds for NAME (ttft, itl, tpot, e2e, queue, prefill, "
        "decode); repeat for several",
    )
    p.add_argument(
        "--log-requests",
        action="store_true",
        help="one JSON line per inference request on stderr (logger lantau.requests)",
    )
    for flag, default, what in (
        ("--allowed-origins", "[]", "origins whose browser pages may call the API (CORS), e.g. "
         '\'["https://support.example.com"]\' (default none: no CORS headers)'),
        ("--allowed-methods", '["*"]', "CORS: the methods allowed"),
        ("--allowed-headers", '["*"]', "CORS: the request headers allowed"),
    ):  # fmt: skip
        p.add_argument(flag, default=default, metavar="JSON_LIST", help=what)
    p.add_argument(
        "--allow-credentials", action="store_true", help="CORS: cookies and auth headers too"
    )
    _add_tls_args(p, "both listeners (HTTP and gRPC)")
    p.add_argument(
        "--chat-template",
        metavar="FILE|TEMPLATE",
        help="a Jinja chat template (a file, or the template itself) in place of the models' own",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="run a chat request's own `chat_template` (off: such a request is a 400)",
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|FOLDER",
        help="sampling defaults for what a request leaves out: the model's "
        "generation_config.json (auto), OpenAI's (vllm), or FOLDER's generation_config.json",
    )
    p.add_argument(
        "--step-log",
        metavar="FILE",
        help="every engine core appends one JSON line a step to FILE: when it began, host and "
        "device time, requests and tokens (where a request's time goes)",
    )


def chat(args: argparse.Namespace) -> int:
    from lantau.errors import ModelLoadError
    from lantau.llm import LLM

    try:
        llm = LLM(
            args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
            kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tensor_parallel_size,
            **engine_options(args),
        )  # fmt: skip
    except (ModelLoadError, OSError, ValueError) as e:
        print(f"lantau chat: {e}", file=sys.stderr)
        return 2
    # the flags, else the model's generation_config.json, else a chat's own defaults
    given = {"temperature": args.temperature, "top_p": args.top_p, "max_tokens": args.max_tokens}
    params = SamplingParams(**{
        **CHAT_SAMPLING, **llm.sampling_defaults,
        **{k: v for k, v in given.items() if v is not None},
    })  # fmt: skip
    conversation: list[dict] = []
    print(
        f"lantau chat on {llm.config.model} ({llm.config.device}; temperature "
        f"{params.temperature}, top_p {params.top_p}, max_tokens {params.max_tokens}). Empty "
        "line or Ctrl-D quits."
    )
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        conversation.append({"role": "user", "content": line})
        ids = llm.encode_chat(conversation)
        engine = llm.engine
        engine.add_request("chat", {"prompt_token_ids": ids}, params)
        printed = 0
        reply = ""
        while engine.has_unfinished_requests:
            for output in engine.step():
                reply = output.outputs[0].text
                sys.stdout.write(reply[printed:])
                sys.stdout.flush()
                printed = len(reply)
        print()
        conversation.append({"role": "assistant", "content": reply})
    return 0


def cors_options(args: argparse.Namespace) -> dict:
    """The CORS flags (JSON lists of strings, as vLLM takes them) as ServerConfig fields;
    ValueError naming a bad one."""
    import json

    options = {}
    for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
        flag = "--" + name.replace("_", "-")
        try:
            value = json.loads(getattr(args, name))
        except ValueError:
            value = None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            given = getattr(args, name)
            raise ValueError(f"{flag}: expected a JSON list of strings, got {given!r}")
        options[name] = tuple(value)
    if args.allow_credentials and "*" in options["allowed_origins"]:
        raise ValueError("--allow-credentials: name the origins (not *), which may send them")
    return {**options, "allow_credentials": args.allow_credentials}


def read_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file's template, or the text itself when it reads as Jinja;
    ValueError for neither, or for a template Jinja cannot parse (named with its line)."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        template = path.read_text()
    elif "{{" in value or "{%" in value:
        template = value
    else:
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
    import jinja2.sandbox

    try:
        jinja2.sandbox.ImmutableSandboxedEnvironment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: line {e.lineno}: {e.message}") from None
    return template


def serve(args: argparse.Namespace) -> int:
    import asyncio
    import time

    from lantau.metrics.stats import parse_buckets

    started = time.perf_counter()
    try:
        parse_buckets(args.metrics_buckets or [])
    except ValueError as e:
        print(f"lantau serve: {e}", file=sys.stderr)
        return 2
    repository = _repository_options(args)
    if isinstance(repository, str):
        print(f"lantau serve: {repository}", file=sys.stderr)
        return 2
    from lantau.errors import EngineStartError, ModelLoadError
    from lantau.model.generation_config import check_mode
    from lantau.tls import ServerTls

    try:
        check_mode(args.generation_config)
        chat_template = read_chat_template(args.chat_template)
        cors = cors_options(args)
        tls = ServerTls.of(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs)
    except (ModelLoadError, ValueError) as e:
        print(f"lantau serve: {e}", file=sys.stderr)
        return 2
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        print("lantau serve: --enable-auto-tool-choice and --tool-call-parser go together",
              file=sys.stderr)  # fmt: skip
        return 2
    names = set(args.served_model_name or [args.model or "SmolLM2-135M-Instruct"])
    problem = _lora_problem(args.lora_modules, args.max_loras, names, repository is not None,
                            args.lora_dir)  # fmt: skip
    if problem:
        print(f"lantau serve: {problem}", file=sys.stderr)
        return 2
    engine_args = serve_engine_args(args)
    if args.step_log:  # NOTE: before any engine core spawns: they read it from the environment
        from lantau import envs

        os.environ[envs.STEP_LOG] = os.path.abspath(args.step_log)
    early = None  # the engine core starts while the web stack below imports
    if repository is None:
        from lantau.engine.args import build_engine_config
        from lantau.engine.async_llm import spawn_core

        core_args = dict(engine_args)
        try:
            engine_config, source = build_engine_config(core_args.pop("model"), **core_args)
        except (ModelLoadError, OSError, ValueError) as e:
            print(f"lantau serve: {e}", file=sys.stderr)
            return 2
        early = (engine_config, source, spawn_core(engine_config, source))
    elif repository.control_mode != "explicit" or repository.load_models:
        from lantau.engine.async_llm import spawn_core

        early = spawn_core(None, None)  # a standby: the first version started takes it
    from lantau.server.app import ServerConfig, serve

    config = ServerConfig(
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        served_model_name=(args.served_model_name or [args.model or "SmolLM2-135M-Instruct"])[0],
        served_model_aliases=tuple((args.served_model_name or [])[1:]),
        api_keys=tuple(args.api_key or ()),
        max_pending_requests=args.max_pending_requests,
        max_pending_tokens=args.max_pending_tokens,
        drain_timeout_s=args.drain_timeout,
        live_max_silence_s=args.liveness_timeout,
        max_n=args.max_n,
        max_logprobs=args.max_logprobs,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        enable_metrics=args.enable_metrics,
        metrics_buckets=tuple(args.metrics_buckets or ()),
        log_requests=args.log_requests,
        generation_config=args.generation_config,
        chat_template=chat_template,
        trust_request_chat_template=args.trust_request_chat_template,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        lora_dir=args.lora_dir,
        **cors,
        tls=tls,
    )
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        return asyncio.run(serve(engine_args, config, repository, early, started))
    except EngineStartError as e:  # the core's own reason, not the frontend's traceback
        print(f"lantau serve: {e}", file=sys.stderr)
        return 1


def serve_engine_args(args: argparse.Namespace) -> dict:
    """`lantau serve`'s arguments to build_engine_config (`build --compile-kernels` warms up
    with their defaults)."""
    engine_args = dict(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        scheduling_policy=args.scheduling_policy,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        async_scheduling=args.async_scheduling,
        tensor_parallel_size=args.tensor_parallel_size,
        lora_modules=tuple(args.lora_modules or ()),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        **engine_options(args),
    )
    if args.max_num_batched_tokens is None and args.enable_chunked_prefill:
        engine_args["max_num_batched_tokens"] = SERVE_MAX_NUM_BATCHED_TOKENS
    if args.num_kv_blocks:
        engine_args["num_kv_blocks"] = args.num_kv_blocks
    return engine_args


def _lora_problem(
    specs: list[str] | None,
    max_loras: int,
    served_names: set[str],
    repository: bool,
    lora_dir: str | None = None,
) -> str | None:
    """Why `--lora-modules` / `--max-loras` / `--lora-dir` cannot be served as given, or
    None."""
    if not specs and not max_loras and lora_dir is None:
        return None
    if repository:
        return (
            "--lora-modules: not with a model repository (a model's adapters are its "
            "config.pbtxt's parameters lora_modules and max_loras)"
        )
    from lantau.model.lora import parse_lora_modules

    try:
        modules = parse_lora_modules(specs)
    except ValueError as e:
        return str(e)
    if lora_dir is not None:
        if not os.path.isdir(lora_dir):
            return f"--lora-dir {lora_dir}: not a folder"
        if max_loras <= len(modules):
            return (f"--lora-dir needs a slot beyond the --lora-modules adapters': --max-loras "
                    f"{len(modules) + 1} or more")  # fmt: skip
    taken = sorted({name for name, _ in modules} & served_names)
    return f"lora module {taken[0]!r}: the served model's own name" if taken else None


def engine_options(args: argparse.Namespace) -> dict:
    """_add_engine_args' flags, as build_engine_config's arguments."""
    return dict(
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
    )


def _repository_options(args: argparse.Namespace):
    """RepositoryOptions for --model-repository (or a MODEL that is a repository folder),
    None for a fixed model, or an error message."""
    from lantau.server.repository import is_repository

    path = args.model_repository
    if (
        path is None
        and args.model
        and Path(args.model).is_dir()
        and is_repository(Path(args.model))
    ):
        path = args.model
    if path is None:
        if args.load_model or args.model_control_mode:
            return "--load-model and --model-control-mode need --model-repository"
        return None
    if args.model and args.model_repository:
        return "give a MODEL or --model-repository, not both"
    from lantau.server.repository import RepositoryOptions

    if not Path(path).is_dir():
        return f"--model-repository: {path}: no such folder"
    mode = args.model_control_mode or "none"
    if args.load_model and mode != "explicit":
        return "--load-model needs --model-control-mode explicit"
    return RepositoryOptions(
        path=Path(path),
        control_mode=mode,
        load_models=tuple(args.load_model or ()),
        poll_secs=args.repository_poll_secs,
    )


def build(args: argparse.Namespace) -> int:
    import time

    from lantau.errors import ModelLoadError
    from lantau.model.manifest import check_dtype_available

    started = time.perf_counter()
    try:
        if args.dtype != "auto":  # a bad name is refused before torch loads
            check_dtype_available(args.dtype)
        if args.compile_kernels:  # refused before any work without the GPU it compiles for
            from lantau.model.kernel_cache import check_can_compile_kernels

            check_can_compile_kernels()
        from lantau.model.build import build_engine

        manifest = build_engine(args.src, args.out, dtype=args.dtype, seed=args.seed,
                                device=args.device,
                                tensor_parallel_size=args.tensor_parallel_size)  # fmt: skip
    except (ModelLoadError, OSError, ValueError) as e:
        print(f"lantau build: {e}", file=sys.stderr)
        return 1
    print(
        f"lantau build: {args.out}: {len(manifest.shards)} shard(s), {manifest.dtype}, "
        f"fingerprint {manifest.fingerprint[:12]} ({time.perf_counter() - started:.1f} s)"
    )
    return _compile_kernels(args.out) if args.compile_kernels else 0


def _compile_kernels(out: str) -> int:
    """`build --compile-kernels`' second half: the built folder warmed up as `lantau serve
    FOLDER` would start it, its Triton cache kept in FOLDER/kernels/<key>/."""
    import time

    from lantau.model.kernel_cache import compile_kernels

    started = time.perf_counter()
    serve_args = serve_engine_args(make_parser().parse_args(["serve"]))
    serve_args.pop("model")
    try:
        info = compile_kernels(Path(out), serve_args)
    except Exception as e:  # the folder is complete and serves; only its kernels are missing
        print(f"lantau build: {out} is built, but compiling its kernels failed: {e!r}",
              file=sys.stderr)  # fmt: skip
        return 1
    print(
        f"lantau build: {out}/kernels/{info['name']}: {info['num_entries']} Triton cache "
        f"entries, {info['num_files']} files ({time.perf_counter() - started:.1f} s)"
    )
    return 0


def rollback(args: argparse.Namespace) -> int:
    """POST /v2/repository/models/NAME/rollback on a running server."""
    import json
    import urllib.error
    import urllib.parse
    import urllib.request

    body = json.dumps({"version": args.to} if args.to else {}).encode()
    name = urllib.parse.quote(args.name, safe="")
    request = urllib.request.Request(
        f"{args.url.rstrip('/')}/v2/repository/models/{name}/rollback",
        data=body,
        headers={"content-type": "application/json",
                 **({"x-api-key": args.api_key} if args.api_key else {})},
    )  # fmt: skip
    context = None
    if args.ssl_ca_certs is not None:  # an https:// server's private CA
        import ssl

        context = ssl.create_default_context(cafile=args.ssl_ca_certs)
    try:
        with urllib.request.urlopen(request, timeout=args.timeout, context=context) as response:
            served = json.loads(response.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        print(f"lantau rollback: {e.code}: {detail}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as e:
        print(f"lantau rollback: {args.url}: {e}", file=sys.stderr)
        return 1
    print(f"lantau rollback: {served['name']} now serves version {served['version']}")
    return 0


def route(args: argparse.Namespace) -> int:
    """The gateway: lantau/gateway/proxy.py in front of the --backend replicas."""
    from lantau.gateway.proxy import GatewayConfig, run
    from lantau.tls import ClientTls, ServerTls

    def backend_client(args: argparse.Namespace) -> ClientTls:
        if (args.backend_certfile is None) != (args.backend_keyfile is None):
            raise ValueError("--backend-certfile and --backend-keyfile go together")
        return ClientTls(args.backend_ca_certs, args.backend_certfile, args.backend_keyfile)

    try:
        config = GatewayConfig(
            backends=tuple(args.backend), grpc_backends=tuple(args.grpc_backend),
            grpc_port=args.grpc_port, host=args.host, port=args.port, policy=args.policy,
            health_interval_s=args.health_interval, max_attempts=args.max_attempts,
            connect_timeout_s=args.connect_timeout, drain_timeout_s=args.drain_timeout,
            max_body_bytes=args.max_body_bytes, session_header=args.session_header,
            admin_key=args.admin_key, backend_api_key=args.backend_api_key,
            backend_dns=tuple(args.backend_dns), grpc_backend_dns=tuple(args.grpc_backend_dns),
            tls=ServerTls.of(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs),
            backend_tls=args.backend_tls, backend_client=backend_client(args),
        )  # fmt: skip
    except ValueError as e:
        print(f"lantau route: {e}", file=sys.stderr)
        return 2
    run(config)
    return 0


def bench(args: argparse.Namespace) -> int:
    import json

    from lantau.bench.offline import bench_offline, print_report

    result = bench_offline(args)
    print_report(result)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def _add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    """`bench serve` and `bench sweep`; the aliases are `vllm bench serve`'s names."""
    p.add_argument("--url", "--base-url", dest="url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions", help="or /v1/chat/completions")
    p.add_argument("--model", default=None, help="the body's model field (default: the server's)")
    p.add_argument("--workload", default="W1", help="W1 | W5 | random:IN/OUT | sharegpt:FILE")
    p.add_argument("--num-requests", "--num-prompts", dest="num_requests", type=int)
    p.add_argument("--concurrency", "--max-concurrency", dest="concurrency", type=int)
    p.add_argument("--burstiness", type=float, default=1.0, help="1: Poisson arrivals")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo", "--goodput", dest="slo", default="ttft=350ms,tpot=50ms")
    p.add_argument(
        "--ignore-eos", action=argparse.BooleanOptionalAction, help="default: on but for ShareGPT"
    )
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--ssl-ca-certs",
        metavar="PEM",
        help="an https:// server's certificate checked against these CAs",
    )
    p.add_argument("--insecure", action="store_true",
                   help="an https:// server's certificate not checked")  # fmt: skip
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request")
    p.add_argument("--vocab-size", type=int, default=32000, help="random ids are drawn below it")
    p.add_argument(
        "--json-schema", default=None, metavar="FILE",
        help="structured outputs: requests carry this schema (response_format json_schema)",
    )  # fmt: skip
    p.add_argument(
        "--structured-output-ratio", type=float, default=1.0,
        help="with --json-schema: the share of requests that carry it",
    )  # fmt: skip
    p.add_argument(
        "--lora-modules", nargs="+", default=None, metavar="NAME",
        help="LoRA adapters the server serves: each request names one, picked at random",
    )  # fmt: skip
    p.add_argument("--sharegpt-output-len", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--gpu-index", default="0", help="NVML devices of this machine, e.g. 0,1")
    p.add_argument("--metrics-interval", type=float, default=1.0, help="seconds")
    p.add_argument("--no-probe", dest="probe", action="store_false", help="no first test request")
    p.add_argument("--disable-tqdm", "--no-progress", dest="progress", action="store_false")
    p.add_argument("--out", "--result-dir", dest="out", default=None, help="the report's folder")
    p.add_argument("--save-result", action="store_true", help="without --out: bench-<time>/")
    p.add_argument("--before", default=None, help="a results.json (or its folder) to compare")
    p.add_argument(
        "--step-log",
        metavar="FILE",
        help="the server's `lantau serve --step-log` file (a server on this machine): the run's "
        "engine steps by kind, with their device and host times, in the report",
    )


def bench_online(args: argparse.Namespace) -> int:
    import time

    from lantau.bench import report
    from lantau.bench.serve import (
        config_from_args,
        doubling_rates,
        parse_rates,
        run_serve,
        run_sweep,
    )

    try:
        before = report.load_result(args.before) if args.before else None
        config = config_from_args(args)
        if args.mode == "sweep":
            rates = parse_rates(args.rates) if args.rates else None
            result = run_sweep(config, rates or doubling_rates(args.start_rate, args.max_rate))
        else:
            result = run_serve(config)
    except (OSError, RuntimeError, ValueError) as e:
        print(f"lantau bench {args.mode}: {e}", file=sys.stderr)
        return 1
    data = result.to_dict()
    print(report.summary_text(data))
    out = args.out or (
        time.strftime(f"bench-{args.mode}-%Y%m%d-%H%M%S") if args.save_result else None
    )
    if out:
        report.write_report(data, out, before)
        print(f"report: {out}/report.md, report.html, results.json")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    return args.func(args)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lantau")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("chat", help="interactive chat in the terminal")
    _add_model_args(p)
    _add_engine_args(p)
    help = "default: the model's generation_config.json, else {}"
    p.add_argument("--temperature", type=float, help=help.format(CHAT_SAMPLING["temperature"]))
    p.add_argument("--top-p", type=float, help=help.format(CHAT_SAMPLING["top_p"]))
    p.add_argument("--max-tokens", type=int, help=help.format(CHAT_SAMPLING["max_tokens"]))
    p.set_defaults(func=chat)

    p = sub.add_parser("serve", help="OpenAI and KServe v2 (HTTP, gRPC) server")
    _add_model_args(p)
    _add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001, help="0: no gRPC server")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the name(s) requests use for the model (the first is the one answers name)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) served beside the model, each under its NAME: a "
        "request naming it as its model runs with it (docs/lora.md)",
    )
    p.add_argument(
        "--enable-lora",
        action="store_true",
        help="accepted for vLLM's command lines: the adapters are --lora-modules' (and "
        "--max-loras' slots)",
    )
    p.add_argument("--max-loras", type=int, default=0,
                   help="adapter slots (default: one a --lora-modules adapter); more leave room "
                        "for /v1/load_lora_adapter")  # fmt: skip
    p.add_argument(
        "--max-lora-rank",
        type=int,
        default=0,
        help="the largest rank a slot holds (default: the modules' largest, else 16)",
    )
    p.add_argument(
        "--lora-dir",
        default=None,
        metavar="DIR",
        help="every PEFT adapter folder DIR/NAME is served as NAME, loaded on its first request "
        "into a free --max-loras slot (or the least recently used idle one's)",
    )
    p.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (off: a client cannot "
        "make the server read a path of its choosing)",
    )
    p.add_argument(
        "--model-repository", default=None, help="a Triton-style repository: REPO/NAME/VERSION"
    )
    p.add_argument(
        "--model-control-mode", choices=["none", "poll", "explicit"], default=None,
        help="none (default): all loaded at start; poll: rescanned; explicit: the load API",
    )  # fmt: skip
    p.add_argument("--load-model", action="append", help="explicit mode: load at start")
    p.add_argument("--repository-poll-secs", type=float, default=15.0, help="poll mode")
    p.add_argument("--api-key", action="append", help="repeat for several keys")
    p.add_argument("--max-num-seqs", type=int, default=SERVE_MAX_NUM_SEQS)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help=f"tokens a step may compute (chunked prefill's budget; default "
        f"{SERVE_MAX_NUM_BATCHED_TOKENS}, or max_model_len without chunked prefill)",
    )
    p.add_argument("--num-kv-blocks", type=int, default=None)
    _add_scheduling_args(p, long_prefill_tokens=SERVE_LONG_PREFILL_TOKENS)
    p.add_argument("--max-pending-requests", type=int, default=1024, help="then 429")
    p.add_argument("--max-pending-tokens", type=int, default=1 << 20, help="then 429")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds, on SIGTERM")
    p.add_argument(
        "--liveness-timeout", type=float, default=30.0, help="seconds of engine silence (hung)"
    )
    p.add_argument("--max-n", type=int, default=128, help="samples a request may ask (n)")
    p.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        help="top logprobs a token may ask (OpenAI's limits, 5 and 20, hold below it)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="chat requests' `tools`: to the chat template, calls read back from the answer",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json"],
        help="the model family's tool-call format (with --enable-auto-tool-choice)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=["deepseek_r1", "qwen3"],
        help="a reasoning model's thinking apart from its answer: reasoning_content on chat",
    )
    _add_observability_args(p)
    p.set_defaults(func=serve)

    p = sub.add_parser("build", help="an engine folder (REPO/NAME/VERSION) from a model")
    p.add_argument("src", help="HF folder, .gguf file or random:NAME")
    p.add_argument("--out", required=True, help="the engine folder, e.g. REPO/NAME/VERSION")
    p.add_argument(
        "--dtype",
        default="auto",
        help="bf16 | fp16 | fp32 | fp8 (auto: fp8 for an FP8 checkpoint, else bf16)",
    )
    p.add_argument("--seed", type=int, default=0, help="random weights' seed")
    p.add_argument("--device", default="auto", help="where the model is built (auto: CUDA)")
    p.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1,
        help="ranks to split it over: each rank's slice in its own shards",
    )  # fmt: skip
    p.add_argument(
        "--compile-kernels",
        action="store_true",
        help="also warm the folder up as `lantau serve` would and keep the compiled Triton "
        "kernels in FOLDER/kernels/ (needs the GPU it will be served on)",
    )
    p.set_defaults(func=build)

    p = sub.add_parser("rollback", help="a served model back to an earlier version")
    p.add_argument("name", help="the repository model's name")
    p.add_argument("--to", default=None, help="the version (default: the one served before)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server")
    p.add_argument("--api-key", default=None)
    p.add_argument("--ssl-ca-certs", metavar="PEM", help="an https:// server's CA")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds")
    p.set_defaults(func=rollback)

    p = sub.add_parser("route", help="a gateway over several servers: routing, retries, failover")
    p.add_argument("--backend", action="append", default=[], metavar="URL",
                   help="a replica's HTTP base URL (repeat for each)")  # fmt: skip
    p.add_argument("--backend-dns", action="append", default=[], metavar="NAME:PORT",
                   help="a DNS name whose addresses are replicas (a Kubernetes headless "
                        "Service), looked up each health round")  # fmt: skip
    p.add_argument(
        "--grpc-backend",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a replica's KServe v2 gRPC port (repeat for each; needs --grpc-port)",
    )
    p.add_argument("--grpc-backend-dns", action="append", default=[], metavar="NAME:PORT",
                   help="a DNS name whose addresses are replicas' gRPC ports")  # fmt: skip
    p.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        help="the gateway's gRPC port, relaying to the --grpc-backend replicas",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--policy", default="least-loaded",
                   help="least-loaded (default), round-robin, or session (a session's requests "
                        "on one replica, for its prefix cache; bounded load)")  # fmt: skip
    p.add_argument("--session-header", default="x-session-id",
                   help="the session policy's key (else an OpenAI body's `user`)")  # fmt: skip
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds")
    p.add_argument("--max-attempts", type=int, default=3, help="replicas tried for a request")
    p.add_argument("--connect-timeout", type=float, default=5.0, help="seconds")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds the requests in flight get after SIGTERM")  # fmt: skip
    p.add_argument("--max-body-bytes", type=int, default=4 << 20)
    p.add_argument("--admin-key", default=None,
                   help="the key for adding and removing backends (POST / DELETE "
                        "/gateway/backends); without one they are refused")  # fmt: skip
    p.add_argument("--backend-api-key", default=None,
                   help="the replicas' API key, for the gateway's own reads of their /v1/models "
                        "(clients' requests carry their own)")  # fmt: skip
    _add_tls_args(p, "the gateway's own listeners (HTTP and gRPC)")
    p.add_argument(
        "--backend-tls",
        action="store_true",
        help="replicas found by DNS, and gRPC ones, speak TLS (https:// URLs always)",
    )
    p.add_argument("--backend-ca-certs", metavar="PEM",
                   help="the CAs replicas' certificates are checked against (default: the "
                        "system's)")  # fmt: skip
    p.add_argument(
        "--backend-certfile",
        metavar="PEM",
        help="the gateway's certificate, for replicas under mutual TLS",
    )
    p.add_argument("--backend-keyfile", metavar="PEM", help="its key")
    p.set_defaults(func=route)

    b = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="mode", required=True)
    p = b.add_parser("offline", help="the in-process engine on a standard workload")
    p.add_argument("--model", default="random:llama3-8b")
    _add_dtype_arg(p)
    p.add_argument(
        "--workload", default="W2", help="W2 | W5 | W3-1000 | W3-128 | W3-2048 | in:N/out:M"
    )
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--peer", action="append", choices=["hf", "hf-static"], help="HF generate too")
    p.add_argument("--peer-prompts", type=int, default=None, help="prompts the peer runs")
    p.add_argument("--max-num-seqs", type=int, default=None, help="W3: 384, else 256")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="W3: 65536, else the engine's"
    )
    p.add_argument("--max-model-len", type=int, default=None)
    _add_kv_cache_dtype_arg(p)
    _add_tensor_parallel_arg(p)
    _add_engine_args(p)
    _add_scheduling_args(p)
    p.add_argument("--output", default=None, help="write the result as JSON here")
    p.set_defaults(func=bench)

    p = b.add_parser("serve", help="streaming load on a running OpenAI-compatible server")
    _add_bench_serve_args(p)
    p.add_argument(
        "--rate", "--request-rate", dest="rate", type=float, default=float("inf"),
        help="requests/s (Poisson); inf: all at once",
    )  # fmt: skip
    p.set_defaults(func=bench_online)
    p = b.add_parser("sweep", help="bench serve at rising rates until the SLO breaks")
    _add_bench_serve_args(p)
    p.add_argument("--rates", default=None, help="e.g. 2,4,8,16,32,inf (default: doubling)")
    p.add_argument("--start-rate", type=float, default=1.0)
    p.add_argument("--max-rate", type=float, default=256.0)
    p.set_defaults(func=bench_online)
    return parser


if __name__ == "__main__":
    sys.exit(main())
