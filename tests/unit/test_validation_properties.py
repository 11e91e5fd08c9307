"""Property-based tests of request validation and of draft decoding (hypothesis).

- ``build_step`` / ``check_sampling``: whatever they are given, they either return (a StepSpec
  that satisfies every invariant the scheduler relies on) or raise ``InvalidRequest`` whose
  ``field`` names a field that exists in the input and whose ``code`` is a gRPC status name;
  never another exception. A valid request with one field spoiled is refused naming exactly
  that field.
- ``store.codec.decode_entry``: arbitrary bytes, and valid encodings cut, flipped or spliced,
  raise only ``CorruptEntry``; what decodes re-encodes to the very same bytes (the encoding is
  canonical); every valid entry round-trips.
"""

from __future__ import annotations

import dataclasses
import math
import re
import struct

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bubblespec.common.types import Prompt, SamplingParams, SchedulingPolicy
from bubblespec.scheduler.core.types import InvalidRequest, ModelLimits, StepSpec
from bubblespec.scheduler.core.validate import Limits, build_step, check_sampling
from bubblespec.store import CorruptEntry, DraftEntry, DraftSource, decode_entry, encode_entry
from bubblespec.store.codec import MAGIC, MAX_STEP_ID_BYTES, MAX_TOKEN_ID

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
ID_ALPHABET = "abcxyzABZ0189._:-"

# ------------------------------------------------------------------ strategies --

EDGE_INTS = [0, 1, -1, 2, 63, 64, 127, 128, 511, 512, 2**31 - 1, -(2**31), 2**62 - 1, 2**62, 2**63 - 1, -(2**63)]
WRONG_TYPES = st.one_of(st.none(), st.booleans(), st.text(max_size=3), st.binary(max_size=2), st.just(()))

ints = st.one_of(st.integers(-3, 80), st.sampled_from(EDGE_INTS), st.integers(-(2**70), 2**70))
reals = st.one_of(st.floats(), st.sampled_from([0.0, -0.0, 1.0, 0.5, 1e-300, 1.0000001, math.nan, math.inf, -math.inf]),
                  st.integers(-2, 3))


def sloppy(strategy, wrong: float = 1):
    """Mostly ``strategy``, sometimes a value of the wrong type."""
    return st.one_of(strategy, strategy, strategy, WRONG_TYPES) if wrong else strategy


ids = st.one_of(
    st.sampled_from(["p0", "p1", "a", "step-1", "x" * 128]),
    st.text(alphabet=ID_ALPHABET, min_size=1, max_size=130),
    st.text(max_size=6),
    st.sampled_from(["", "../x", "a/b", "p\x00", "\N{FIRE}", "x" * 129, " p0"]),
)
token_lists = st.lists(sloppy(st.one_of(st.integers(-2, 70), st.sampled_from(EDGE_INTS))), max_size=70).map(tuple)
texts = st.text(max_size=70)


@st.composite
def prompts(draw, valid: bool = False, vocab: int = 64, room: int = 64):
    if valid:
        n = draw(st.integers(1, min(8, room - 1)))
        ids_ = tuple(draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n)))
        return Prompt("p", token_ids=ids_,
                      max_tokens=draw(st.integers(0, room - n)))
    kind = draw(st.sampled_from(["ids", "text", "both", "neither"]))
    return Prompt(
        prompt_id=draw(sloppy(ids)),
        text=draw(texts) if kind in ("text", "both") else None,
        token_ids=draw(token_lists) if kind in ("ids", "both") else None,
        max_tokens=draw(sloppy(ints)),
    )


samplings = st.builds(
    SamplingParams,
    temperature=sloppy(reals), top_p=sloppy(reals), top_k=sloppy(ints), max_tokens=sloppy(ints),
    stop=st.lists(st.text(max_size=3), max_size=4).map(tuple),
    stop_token_ids=st.lists(sloppy(ints), max_size=3).map(tuple),
    seed=st.one_of(st.none(), sloppy(ints)), n=sloppy(ints), ignore_eos=st.booleans(),
    min_tokens=sloppy(ints), logprobs=sloppy(ints), skip_special_tokens=st.booleans(),
)
model_limits = st.builds(ModelLimits, max_model_len=st.integers(2, 64), vocab_size=st.integers(1, 64))
limits = st.builds(Limits, max_prompts=st.integers(1, 4), max_samples=st.integers(1, 4),
                   max_lookahead=st.integers(0, 3), max_stop_strings=st.integers(0, 2))
tokenizers = st.sampled_from([None, "chars", "empty"])


def tokenizer(kind: str | None):
    """A stand-in for the scheduler's tokenizer; "chars" may leave the model's vocabulary."""
    if kind == "chars":
        return lambda text: tuple(ord(c) % 200 for c in text)
    if kind == "empty":
        return lambda text: ()
    return None


# ------------------------------------------------------------------- helpers --


def resolve(field: str, inputs: dict) -> object:
    """Follow ``field`` ("prompts[3].token_ids[0]", "sampling.top_p") into ``inputs``; raise
    LookupError/AttributeError when it names nothing there."""
    obj: object = inputs
    for part in field.split("."):
        m = re.fullmatch(r"([A-Za-z_]+)((?:\[\d+\])*)", part)
        assert m, f"malformed field {field!r}"
        name = m.group(1)
        if isinstance(obj, dict):
            obj = obj[name]
        else:
            assert name in {f.name for f in dataclasses.fields(obj)}, f"{field!r}: no field {name!r}"
            obj = getattr(obj, name)
        for index in re.findall(r"\[(\d+)\]", m.group(2)):
            obj = obj[int(index)]  # type: ignore[index]
    return obj


def check_refusal(exc: InvalidRequest, inputs: dict) -> None:
    assert exc.code in grpc.StatusCode.__members__, exc.code
    resolve(exc.field, inputs)
    message = str(exc)
    assert message.startswith(exc.field + ": ") and len(message) <= 400, message


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_sampling_invariants(sp: SamplingParams, lim: Limits, model: ModelLimits) -> None:
    assert is_int(sp.n) and 1 <= sp.n <= lim.max_samples
    assert isinstance(sp.temperature, (int, float)) and math.isfinite(sp.temperature) and sp.temperature >= 0
    assert isinstance(sp.top_p, (int, float)) and math.isfinite(sp.top_p) and 0 < sp.top_p <= 1
    assert is_int(sp.top_k) and (sp.top_k == -1 or sp.top_k >= 1)
    assert is_int(sp.max_tokens) and 1 <= sp.max_tokens < model.max_model_len
    assert len(sp.stop) <= lim.max_stop_strings and all(sp.stop)
    assert all(is_int(t) and 0 <= t < model.vocab_size for t in sp.stop_token_ids)
    assert sp.seed is None or (is_int(sp.seed) and -(2**63) <= sp.seed < 2**63)
    assert is_int(sp.min_tokens) and 0 <= sp.min_tokens <= sp.max_tokens
    assert is_int(sp.logprobs) and 0 <= sp.logprobs <= lim.max_logprobs


def check_step_invariants(spec: StepSpec, inputs: dict, lim: Limits, model: ModelLimits) -> None:
    assert ID.match(spec.step_id) and spec.step_id == inputs["step_id"]
    assert 1 <= len(spec.prompts) <= lim.max_prompts and len(spec.prompts) == len(inputs["prompts"])
    assert len({p.prompt_id for p in spec.prompts}) == len(spec.prompts)
    check_sampling_invariants(spec.sampling, lim, model)
    for p, given_p in zip(spec.prompts, inputs["prompts"], strict=True):
        assert ID.match(p.prompt_id) and p.prompt_id == given_p.prompt_id
        assert 1 <= len(p.token_ids) < model.max_model_len
        assert all(is_int(t) and 0 <= t < model.vocab_size for t in p.token_ids)
        assert is_int(p.max_tokens) and 1 <= p.max_tokens and len(p.token_ids) + p.max_tokens <= model.max_model_len
    assert len(spec.lookahead) == len(inputs["lookahead"]) <= lim.max_lookahead
    for ids_ in spec.lookahead:
        assert 1 <= len(ids_) < model.max_model_len and all(is_int(t) and 0 <= t < model.vocab_size for t in ids_)
    assert re.fullmatch(r"[0-9a-f]{32}", spec.fingerprint)
    assert spec.num_requests == len(spec.prompts) * spec.sampling.n


def call_build(inputs: dict, lim: Limits, model: ModelLimits, tok):
    return build_step(step_id=inputs["step_id"], policy_version=inputs["policy_version"], prompts=inputs["prompts"],
                      sampling=inputs["sampling"], lookahead=inputs["lookahead"], policy=inputs["policy"],
                      limits=lim, model=model, tokenize=tokenizer(tok))


# -------------------------------------------------------------- validation --


@FAST
@given(sp=samplings, lim=limits, model=model_limits)
def test_check_sampling_accepts_only_what_satisfies_the_invariants(sp, lim, model):
    try:
        check_sampling(sp, lim, model)
    except InvalidRequest as exc:
        assert exc.field.startswith("sampling.")
        check_refusal(exc, {"sampling": sp})
    else:
        check_sampling_invariants(sp, lim, model)


@st.composite
def valid_requests(draw):
    model = draw(st.builds(ModelLimits, max_model_len=st.integers(4, 64), vocab_size=st.integers(2, 64)))
    lim = draw(limits)
    max_tokens = draw(st.integers(1, model.max_model_len // 2))
    room = model.max_model_len - max_tokens
    n_prompts = draw(st.integers(1, lim.max_prompts))
    ps = [dataclasses.replace(draw(prompts(valid=True, vocab=model.vocab_size, room=room + 1)), prompt_id=f"p{i}",
                              max_tokens=0) for i in range(n_prompts)]
    sp = SamplingParams(
        temperature=draw(st.floats(0, 5)), top_p=draw(st.floats(0, 1, exclude_min=True)),
        top_k=draw(st.sampled_from([-1, 1, 5])), max_tokens=max_tokens,
        stop=tuple(draw(st.lists(st.text(min_size=1, max_size=3), max_size=lim.max_stop_strings))),
        stop_token_ids=tuple(draw(st.lists(st.integers(0, model.vocab_size - 1), max_size=2))),
        seed=draw(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1))), n=draw(st.integers(1, lim.max_samples)),
        min_tokens=draw(st.integers(0, max_tokens)), logprobs=draw(st.integers(0, lim.max_logprobs)),
    )
    ahead = [Prompt(f"l{i}", token_ids=draw(prompts(valid=True, vocab=model.vocab_size, room=model.max_model_len)
                                            ).token_ids) for i in range(draw(st.integers(0, lim.max_lookahead)))]
    inputs = dict(step_id=draw(st.text(alphabet=ID_ALPHABET, min_size=1, max_size=128)), policy_version=draw(ints),
                  prompts=ps, sampling=sp, lookahead=ahead, policy=draw(st.sampled_from(SchedulingPolicy)))
    return inputs, lim, model


@FAST
@given(request=valid_requests())
def test_valid_requests_build_deterministically(request):
    inputs, lim, model = request
    spec = call_build(inputs, lim, model, None)
    check_step_invariants(spec, inputs, lim, model)
    assert call_build(inputs, lim, model, None).fingerprint == spec.fingerprint


SAMPLING_WILD = {"temperature": sloppy(reals), "top_p": sloppy(reals), "top_k": sloppy(ints),
                 "max_tokens": sloppy(ints), "n": sloppy(ints), "seed": st.one_of(st.none(), sloppy(ints)),
                 "stop": st.lists(st.text(max_size=3), max_size=4).map(tuple),
                 "stop_token_ids": st.lists(sloppy(ints), max_size=3).map(tuple),
                 "min_tokens": sloppy(ints), "logprobs": sloppy(ints)}


@st.composite
def wild_requests(draw):
    """A valid request with any subset of its parts replaced by arbitrary values, so that every
    check, deep ones included, meets hostile input."""
    inputs, lim, model = draw(valid_requests())
    rarely = st.integers(0, 3).map(lambda x: x == 0)
    if draw(rarely):
        inputs["step_id"] = draw(sloppy(ids))
    wild = {name: draw(strategy) for name, strategy in SAMPLING_WILD.items() if draw(rarely)}
    inputs["sampling"] = dataclasses.replace(inputs["sampling"], **wild)
    for key in ("prompts", "lookahead"):
        items = [draw(prompts()) if draw(rarely) else p for p in inputs[key]]
        if draw(rarely):
            items += draw(st.lists(prompts(), max_size=3))
        if draw(rarely):
            items = items[: draw(st.integers(0, len(items)))]
        inputs[key] = items
    if draw(rarely):
        model = draw(model_limits)
    return inputs, lim, model, draw(tokenizers)


@FAST
@given(request=wild_requests())
def test_build_step_returns_a_sound_spec_or_names_a_real_field(request):
    inputs, lim, model, tok = request
    try:
        spec = call_build(inputs, lim, model, tok)
    except InvalidRequest as exc:
        check_refusal(exc, inputs)
    else:
        check_step_invariants(spec, inputs, lim, model)


def _spoil_sampling(name, value):
    def spoil(inputs, model):
        inputs["sampling"] = dataclasses.replace(inputs["sampling"], **{name: value})
        return f"sampling.{name}"
    return spoil


def _spoil_prompt(make_field):
    def spoil(inputs, model):
        p = inputs["prompts"][-1]
        i = len(inputs["prompts"]) - 1
        new, field = make_field(p, model)
        inputs["prompts"][-1] = new
        return field.format(i=i)
    return spoil


SPOILERS = {
    "step_id": lambda inputs, model: (inputs.__setitem__("step_id", "a/b"), "step_id")[1],
    "temperature": _spoil_sampling("temperature", math.nan),
    "top_p": _spoil_sampling("top_p", 0.0 - 1.0),
    "top_k": _spoil_sampling("top_k", 0),
    "n": _spoil_sampling("n", 0),
    "seed": _spoil_sampling("seed", 2**63),
    "min_tokens": _spoil_sampling("min_tokens", -1),
    "logprobs": _spoil_sampling("logprobs", 21),
    "max_tokens": _spoil_sampling("max_tokens", 0),
    "stop": _spoil_sampling("stop", ("",)),
    "prompt_id": _spoil_prompt(lambda p, m: (dataclasses.replace(p, prompt_id="../x"), "prompts[{i}].prompt_id")),
    "token": _spoil_prompt(lambda p, m: (dataclasses.replace(p, token_ids=(*p.token_ids[:-1], m.vocab_size)),
                                         f"prompts[{{i}}].token_ids[{len(p.token_ids) - 1}]")),
    "empty_prompt": _spoil_prompt(lambda p, m: (dataclasses.replace(p, token_ids=()), "prompts[{i}]")),
    "prompt_max_tokens": _spoil_prompt(lambda p, m: (dataclasses.replace(p, max_tokens=-1), "prompts[{i}].max_tokens")),
    "too_many": lambda inputs, model: (inputs.__setitem__("prompts", inputs["prompts"] * 5), "prompts")[1],
}


@FAST
@given(request=valid_requests(), which=st.sampled_from(sorted(SPOILERS)))
def test_one_spoiled_field_is_refused_by_name(request, which):
    inputs, lim, model = request
    inputs = dict(inputs, prompts=list(inputs["prompts"]))
    field = SPOILERS[which](inputs, model)
    if which == "too_many" and len(inputs["prompts"]) <= lim.max_prompts:
        return
    if which == "too_many":  # duplicates would be refused first otherwise
        inputs["prompts"] = [dataclasses.replace(p, prompt_id=f"q{i}") for i, p in enumerate(inputs["prompts"])]
    with pytest.raises(InvalidRequest) as err:
        call_build(inputs, lim, model, None)
    assert err.value.field == field, str(err.value)
    check_refusal(err.value, inputs)


# ------------------------------------------------------------- draft codec --

entries = st.builds(
    DraftEntry,
    tokens=st.lists(st.integers(0, MAX_TOKEN_ID), max_size=32).map(tuple),
    policy_version=st.integers(-(2**63), 2**63 - 1),
    step_id=st.text(max_size=40).filter(lambda s: len(s.encode("utf-8", "surrogatepass")) <= MAX_STEP_ID_BYTES
                                        and not any(0xD800 <= ord(c) <= 0xDFFF for c in s)),
    source=st.sampled_from(DraftSource),
    created_at=st.floats(allow_nan=False, allow_infinity=False),
)


def decodes_canonically_or_is_corrupt(data: bytes) -> None:
    """The only outcomes: CorruptEntry, or an entry whose encoding is exactly ``data``."""
    try:
        entry = decode_entry(data)
    except CorruptEntry:
        return
    assert encode_entry(entry) == bytes(data)


@FAST
@given(entry=entries)
def test_round_trip(entry):
    data = encode_entry(entry)
    assert decode_entry(data) == entry
    assert decode_entry(bytearray(data)) == entry and decode_entry(memoryview(data)) == entry


@FAST
@given(data=st.binary(max_size=300))
def test_arbitrary_bytes_raise_only_corrupt_entry(data):
    decodes_canonically_or_is_corrupt(data)


@FAST
@given(version=st.integers(0, 3), source=st.integers(0, 5), rest=st.binary(max_size=120))
def test_bytes_behind_a_valid_magic_raise_only_corrupt_entry(version, source, rest):
    decodes_canonically_or_is_corrupt(MAGIC + bytes([version, source]) + rest)


@FAST
@given(entry=entries, cut=st.integers(0, 400), flips=st.lists(st.tuples(st.integers(0, 400), st.integers(1, 255)),
                                                              max_size=3),
       splice=st.binary(max_size=8), at=st.integers(0, 400))
def test_mangled_valid_entries_raise_only_corrupt_entry(entry, cut, flips, splice, at):
    data = bytearray(encode_entry(entry))
    decodes_canonically_or_is_corrupt(bytes(data[: cut % (len(data) + 1)]))
    flipped = bytearray(data)
    for pos, mask in flips:
        flipped[pos % len(flipped)] ^= mask
    decodes_canonically_or_is_corrupt(bytes(flipped))
    pos = at % (len(data) + 1)
    decodes_canonically_or_is_corrupt(bytes(data[:pos] + splice + data[pos:]))


@FAST
@given(count=st.integers(0, 2**32 - 1), have=st.integers(0, 16))
def test_token_count_that_lies_is_corrupt(count, have):
    header = struct.pack("<4sBBqdH", MAGIC, 1, 1, 0, 0.0, 0)
    data = header + struct.pack("<I", count) + b"\x01\x00\x00\x00" * have
    if count == have:
        assert len(decode_entry(data).tokens) == have
    else:
        with pytest.raises(CorruptEntry):
            decode_entry(data)
