"""``pagedkv serve``'s flags come from the services' own ``add_args`` (pagedkv/serve_args.py): every flag of the
scheduler and of the executor is either set by serve itself or accepted by serve and found, with the user's
value, in that child's command line. Parsed only; nothing is started."""

from __future__ import annotations

import argparse
import os
from unittest import mock

import pytest

from executor_svc import args as executor_args
from pagedkv.cli import build_parser
from pagedkv.serve_args import BY_ENV, SET_BY_SERVE, _ServiceFlags, child_commands, child_env
from pagedkv.serve_args import add_args as add_serve_args
from scheduler_svc import args as scheduler_args

pytestmark = pytest.mark.unit

EXEC_PORT = 5999
ADD_ARGS = {"scheduler": scheduler_args.add_args, "executor": executor_args.add_args}
FOLLOWS = {"--cuda-graph-max-batch": "--max-num-seqs"}  # serve's default for the first is the second's value
OTHER_VALUES = {"--threads": "3", "--lora-modules": "sql=/tmp/adapters/sql"}  # flags of a type of their own: a value
# other than the default


def service_parser(service: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=service, exit_on_error=False)
    ADD_ARGS[service](p)
    return p


def flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.option_strings[0]: a for a in parser._actions if a.option_strings and a.dest != "help"}


def other_value(action: argparse.Action) -> list[str]:
    """Command-line words that give ``action`` a value other than its default."""
    flag = action.option_strings[0]
    if flag in OTHER_VALUES:
        return [flag, OTHER_VALUES[flag]]
    if isinstance(action, argparse.BooleanOptionalAction):
        return ["--no-" + flag[2:] if action.default else flag]
    if action.nargs == 0:  # store_true
        return [flag]
    if action.choices:
        return [flag, next(str(c) for c in action.choices if c != action.default)]
    if action.type is int:
        return [f"{flag}={(action.default or 0) + 3}"]
    if action.type is float:
        return [f"{flag}={(action.default or 0) + 1.25}"]
    return [flag, f"/tmp/value-of-{action.dest}"]


def children(serve_argv: list[str]) -> tuple[argparse.Namespace, dict[str, argparse.Namespace]]:
    """serve's parsed flags, and each child's from its command line and the environment serve gives it (BY_ENV:
    secrets, which the command line never shows)."""
    args = build_parser().parse_args(["serve", *serve_argv])
    exec_cmd, sched_cmd = child_commands(args, args.forwarded, EXEC_PORT)
    env = child_env(args, args.forwarded)
    parsed = {}
    for service, cmd in (("executor", exec_cmd), ("scheduler", sched_cmd)):
        assert cmd[1:4] == ["-m", "pagedkv", service]
        assert not any(v and v in " ".join(cmd) for v in env.values()), "a secret on a command line"
        with mock.patch.dict(os.environ, env):
            parsed[service] = service_parser(service).parse_args(cmd[4:])
    return args, parsed


def forwarded_flags() -> list[tuple[str, str]]:
    out = []
    for service in ADD_ARGS:
        out += [(service, f) for f in flags(service_parser(service)) if f not in SET_BY_SERVE[service]]
    return out


def test_every_service_flag_is_forwarded_or_set_by_serve():
    parser = argparse.ArgumentParser()
    forwarded = add_serve_args(parser)
    serve = flags(parser)
    for service in ADD_ARGS:
        declared = flags(service_parser(service))
        assert set(SET_BY_SERVE[service]) <= set(declared), "SET_BY_SERVE names a flag the service dropped"
        for flag in declared:
            passed_on = flag in forwarded and service in forwarded[flag].services
            assert passed_on != (flag in SET_BY_SERVE[service]), f"{service} {flag}"
            assert flag in serve or flag in SET_BY_SERVE[service], f"{service} {flag} is missing from serve"
    assert all(a.help for a in serve.values()), [f for f, a in serve.items() if not a.help]


@pytest.mark.parametrize("service,flag", forwarded_flags(), ids=lambda v: v)
def test_each_forwarded_flag_reaches_the_child_with_its_value(service, flag):
    action = flags(service_parser(service))[flag]
    args, parsed = children(other_value(action))
    assert getattr(args, action.dest) != action.default
    assert getattr(parsed[service], action.dest) == getattr(args, action.dest)
    # ...and nothing else changed: every other forwarded flag of either child keeps its default (but the one that
    # follows another: FOLLOWS).
    for other_service, other_flag in forwarded_flags():
        if (other_service, other_flag) != (service, flag) and other_flag != flag and other_flag not in FOLLOWS:
            other = flags(service_parser(other_service))[other_flag]
            assert getattr(parsed[other_service], other.dest) == other.default, (other_service, other_flag)


def test_api_key_goes_to_the_scheduler_in_its_environment():
    assert BY_ENV == {"--api-key": "PAGEDKV_API_KEY"}
    args, parsed = children(["--api-key", "k-123"])
    assert parsed["scheduler"].api_key == "k-123" and child_env(args, args.forwarded) == {"PAGEDKV_API_KEY": "k-123"}


def test_serve_sets_ports_addresses_and_the_secret_itself():
    args, parsed = children(["--host", "0.0.0.0", "--port", "1234", "--metrics-port", "9000", "--tls-cert", "c.pem",
                             "--tls-key", "k.pem"])
    ex, sched = parsed["executor"], parsed["scheduler"]
    assert (ex.host, ex.port, ex.metrics_port, ex.metrics_host) == ("127.0.0.1", EXEC_PORT, 9001, "0.0.0.0")
    assert (ex.tls_cert, ex.insecure, ex.drain_timeout) == ("", False, 30.0)  # loopback only, behind a secret
    assert sched.executor == [f"127.0.0.1:{EXEC_PORT}"] and (sched.host, sched.port) == ("0.0.0.0", 1234)
    assert (sched.metrics_port, sched.metrics_host, sched.tls_cert, sched.tls_key) == (9000, "0.0.0.0", "c.pem",
                                                                                      "k.pem")
    assert ex.executor_secret_file == sched.executor_secret_file == ""  # serve's _supervise adds its own


@pytest.mark.parametrize("argv,expected", [([], 256), (["--max-num-seqs", "48"], 48),
                                           (["--max-num-seqs", "48", "--cuda-graph-max-batch", "16"], 16)])
def test_serve_captures_graphs_up_to_the_scheduler_batch_unless_told(argv, expected):
    args, parsed = children(argv)
    assert parsed["executor"].cuda_graph_max_batch == expected
    assert parsed["scheduler"].max_num_seqs == (48 if argv else 256)


def test_an_executor_alone_captures_up_to_the_scheduler_default():
    from executor_svc.startup import _graph_max_batch

    assert service_parser("executor").parse_args([]).cuda_graph_max_batch is None
    assert _graph_max_batch(service_parser("executor").parse_args([])) == 256
    assert service_parser("scheduler").parse_args([]).max_num_seqs == 256


@pytest.mark.parametrize("argv", [["--insecure"], ["--executors-file", "x"], ["--drain-timeout", "5"],
                                  ["--executor-tls-ca", "ca.pem"], ["--executor-secret-file", "s"]])
def test_serve_refuses_what_it_sets_itself(argv, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *argv])


def test_two_services_may_share_a_flag_only_with_one_meaning():
    forwarded: dict = {}
    group = argparse.ArgumentParser().add_argument_group("x")
    _ServiceFlags("scheduler", group, forwarded).add_argument("--log-format", default="auto", help="a")
    _ServiceFlags("executor", group, forwarded).add_argument("--log-format", default="auto", help="b")
    assert forwarded["--log-format"].services == ["scheduler", "executor"]
    with pytest.raises(TypeError, match="--log-format means different things"):
        _ServiceFlags("executor", group, forwarded).add_argument("--log-format", default="json")


@pytest.mark.parametrize("argv", [["--served-model-name", "a", "b"], ["--served-model-name", "a", "--served-model-name",
                                                                       "b"]])
def test_several_served_model_names_reach_the_scheduler_in_order(argv):
    args, parsed = children(argv)
    assert args.served_model_name == parsed["scheduler"].served_model_name == ["a", "b"]


def test_a_served_model_name_is_bounded_before_anything_starts():
    from pagedkv.executor.v1 import executor_pb2 as pb
    from scheduler_svc.args import MAX_MODEL_NAME_CHARS, check_args

    describe = pb.DescribeResponse(max_position_embeddings=64, num_device_pages=8, block_size=16)
    for names in (["ok", "x" * (MAX_MODEL_NAME_CHARS + 1)], [""]):
        args = service_parser("scheduler").parse_args(["--executor", "h:1", "--served-model-name", *names])
        with pytest.raises(ValueError, match=f"--served-model-name .*: each name must have 1 to "
                                             f"{MAX_MODEL_NAME_CHARS} characters"):
            check_args(args, describe, None)
    args = service_parser("scheduler").parse_args(["--executor", "h:1", "--served-model-name", "a", "b"])
    assert check_args(args, describe, None) == 64


def test_serve_refuses_a_gateway_retention_longer_than_the_scheduler_grants():
    from pagedkv.serve_args import check_flags

    base = ["serve", "--model", "tiny-llama", "--http-port", "8000"]
    check_flags(build_parser().parse_args([*base, "--responses-kv-ttl", "600", "--kv-retention-max-ttl", "600"]))
    with pytest.raises(ValueError, match=r"--responses-kv-ttl 900: .*--kv-retention-max-ttl 600"):
        check_flags(build_parser().parse_args([*base, "--responses-kv-ttl", "900", "--kv-retention-max-ttl", "600"]))
    # no gateway: nothing stores responses, nothing to refuse
    check_flags(build_parser().parse_args(["serve", "--model", "tiny-llama", "--responses-kv-ttl", "900",
                                           "--kv-retention-max-ttl", "600"]))
