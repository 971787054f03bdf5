"""engine.extraArgs that vLLM 0.33.0's own parser would refuse never reach a pod: an
unknown long option is refused by the API server at ``kubectl apply`` (the CRD's CEL
rule, built from the committed table of vLLM's options), and what needs the whole list
(a stray positional, a flag without its value, an ambiguous abbreviation, a bad choice,
a value of the wrong type) is a ``SpecInvalid`` condition and a Warning Event with
vLLM's message, and no pods."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spillway_engine import vllm_cli
from spillway_engine.seam import refused_flag
from tests.helpers import wait_for
from tests.integration.test_hostile import admits_extra_arg, kubectl_apply
from tests.integration.test_operator import Env, infdep, model_configmap

pytestmark = pytest.mark.usefixtures("operator")


@pytest.fixture
def env(api, namespace, cluster):
    e = Env(api, namespace, cluster)
    model_configmap(e.core, namespace, "model", "gemma-3-1b-it.json")
    return e


@pytest.mark.parametrize(("args", "needle"), [
    (["--bogus-flag", "1"], "--bogus-flag"),
    (["--max-num-seqs", "8", "--max_num_seqz=4"], "--max_num_seqz=4"),
    (["--Enforce-Eager"], "--Enforce-Eager"),  # vLLM's names are lower case
    (["--bogus.key=1"], "--bogus.key=1"),  # a dotted JSON argument of no option
])
def test_an_unknown_option_is_refused_at_kubectl_apply(env, tmp_path, args, needle):
    body = infdep("unknown")
    body["spec"]["engine"]["extraArgs"] = args
    proc = kubectl_apply(env, body, tmp_path)
    assert proc.returncode != 0, proc.stdout
    assert "spec.engine.extraArgs[" in proc.stderr, proc.stderr
    assert f"{needle} is not an option of vllm serve 0.33.0" in proc.stderr, proc.stderr
    assert "unrecognized arguments" in proc.stderr
    assert env.deployment("unknown") is None


def test_a_letters_value_of_an_int_option_is_refused_at_kubectl_apply(env, tmp_path):
    """``--name=value`` is one item: the CRD's rule refuses a value no int takes, with
    vLLM's own words."""
    body = infdep("int-value")
    body["spec"]["engine"]["extraArgs"] = ["--max_num_seqs=many"]
    proc = kubectl_apply(env, body, tmp_path)
    assert proc.returncode != 0, proc.stdout
    assert "spec.engine.extraArgs[0]" in proc.stderr, proc.stderr
    assert vllm_cli.refusal(["--max_num_seqs=many"]) in proc.stderr, proc.stderr
    assert env.deployment("int-value") is None


@pytest.mark.parametrize(("args", "message"), [
    (["--max-num-seqs", "8", "stray"], "unrecognized arguments: stray"),
    (["--enforce-eager", "8"], "unrecognized arguments: 8"),
    (["--max-num-seqs"], "argument --max-num-seqs: expected one argument"),
    (["--seed", "--enforce-eager"], "argument --seed: expected one argument"),
    (["--max-num", "8"], "ambiguous option: --max-num could match"),
    (["--enforce-eager=yes"], "ignored explicit argument 'yes'"),
    (["--scheduling-policy", "lifo"], "argument --scheduling-policy: invalid choice: 'lifo'"),
    (["--max-num-seqs", "abc"], "argument --max-num-seqs: invalid int value: 'abc'"),
    (["--mm-processor-cache-gb=most"], "invalid float value: 'most'"),
], ids=["positional", "flag-value", "no-value", "value-is-a-flag", "ambiguous",
        "explicit-on-a-switch", "choice", "int-value", "float-value"])
def test_what_vllm_refuses_in_context_is_spec_invalid(env, args, message):
    """Admitted (no single item is unknown), refused by the operator's full check with
    vLLM's own message: no Deployment, one Warning Event."""
    assert message in vllm_cli.refusal(args)
    name = "ctx-" + str(abs(hash(tuple(args))) % 10**6)
    body = infdep(name)
    body["spec"]["engine"]["extraArgs"] = args
    env.create(body)
    c = env.wait_condition(name, "PlanReady", "False", "SpecInvalid", timeout=30)
    assert "spec.engine.extraArgs" in c["message"], c["message"]
    assert message in c["message"] and "vllm serve 0.33.0" in c["message"], c["message"]
    wait_for(lambda: any(e.reason == "SpecInvalid" and e.type == "Warning"
                         for e in env.events(name)), 30, "the SpecInvalid Event")
    assert env.deployment(name) is None


def test_options_vllm_takes_are_admitted(env):
    body = infdep("fine")
    body["spec"]["engine"]["extraArgs"] = [
        "--max-num-seqs", "8", "--max_num_batched_tokens=4096", "--enforce-eager",
        "--no-enable-log-requests", "--max-num-s", "8", "-O3", "--seed", "-1",
        "--kv-events-config.publisher", "zmq",
    ]
    assert vllm_cli.refusal(body["spec"]["engine"]["extraArgs"]) is not None  # ambiguous
    body["spec"]["engine"]["extraArgs"][5] = "--max-num-se"
    assert vllm_cli.refusal(body["spec"]["engine"]["extraArgs"]) is None
    env.create(body)
    wait_for(lambda: env.deployment("fine"), 60, "the Deployment")


def _names() -> st.SearchStrategy[str]:
    names = vllm_cli.long_option_names()

    def spell(name: str, cut: int, under: bool, upper: bool, tail: str, junk: str) -> str:
        body = name[: max(1, len(name) - cut)] + junk
        body = body.replace("-", "_") if under else body
        return "--" + (body.upper() if upper else body) + tail

    return st.one_of(
        st.builds(spell, st.sampled_from(names), st.integers(0, 30), st.booleans(),
                  st.integers(0, 5).map(lambda n: n == 0),
                  st.sampled_from(["", "=8", ".a=1", ".a", "=x y", "+", "=abc", "=", "=1x"]),
                  st.sampled_from(["", "", "", "x", "-", "z-q"])),
        st.text(alphabet="-_=.aceklmnoprstxz19 ", max_size=14),
    )


def test_admission_refuses_exactly_the_unknown_options_the_table_has(env):
    """The CRD's CEL rules for unknown options and int options' values are built from
    the committed table: over 200 generated tokens (server-side dry run) the API server
    agrees with the rules' Python forms (vllm_cli.unknown_long_flag, bad_int_value) and
    the plan-owned rule's."""

    @settings(max_examples=200, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(_names())
    def check(token):
        unknown = vllm_cli.unknown_long_flag(token) or vllm_cli.bad_int_value(token)
        assert admits_extra_arg(env, token) == (refused_flag(token) is None and not unknown), token
        if unknown:  # and vLLM refuses it, alone, too
            assert vllm_cli.refusal([token]) is not None, token

    check()
