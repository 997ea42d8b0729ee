"""Structured output on the tiny random model: every sampled output follows its grammar.

Random weights make this a real test of the mask: unconstrained, the model emits gibberish (the
control test checks that), so a valid output at temperature 1 over many seeds is the grammar's doing.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from test_engine_core import run
from test_structured_output_schemas import SCHEMAS
from tokenizers import Tokenizer

from cachet.common.v1 import common_pb2
from cachet.engine.engine_core import EngineCore
from cachet.engine.errors import InvalidRequest
from cachet.engine.grammar_matcher import MaskBuilder, RequestGrammar
from cachet.engine.model_runner import ModelRunner
from cachet.engine.request import Request, RequestStatus
from cachet.engine.request_output import RequestOutput
from cachet.engine.sampling_params import SamplingParams
from cachet.engine.scheduler import SchedulerConfig
from cachet.engine.structured_output import GrammarCompiler, GrammarSpec, grammar_spec_from_proto
from cachet.models.tiny import write_tiny_model

# Seeds per grammar: 10 x 8 schemas is 80 sampled documents; the smaller grammars take 5.
SEEDS = range(10)
FEW_SEEDS = range(5)
PROMPT = [1, 504, 3245, 28, 253, 1789, 17, 2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("structured") / "tiny-llama")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, vocab_size=tokenizer.get_vocab_size(), eos_token_ids=[2])


def make_engine(model_dir: Path, compiler: GrammarCompiler, kv_cache_bytes: int = 8 << 20) -> EngineCore:
    runner = ModelRunner(
        model_dir, dtype=torch.float32, device=torch.device("cpu"), kv_cache_bytes=kv_cache_bytes
    )
    config = SchedulerConfig(
        max_model_len=min(runner.max_model_len, 1024),
        max_num_batched_tokens=256,
        max_num_seqs=32,
        eos_token_ids=tuple(runner.eos_token_ids),
    )
    return EngineCore(runner, model="tiny-llama", scheduler_config=config, grammar_compiler=compiler)


def make_request(
    request_id: str, grammar: RequestGrammar | None, seed: int, max_tokens: int = 300, **sampling: object
) -> Request:
    params = SamplingParams(temperature=1.0, seed=seed, **sampling)  # type: ignore[arg-type]
    return Request(request_id, list(PROMPT), params, max_tokens, grammar=grammar)


def text_of(outputs: list[RequestOutput], tokenizer: Tokenizer) -> str:
    tokens = [t for o in outputs for t in o.new_token_ids]
    assert 2 not in tokens[:-1], "nothing may follow the end-of-sequence token"
    return tokenizer.decode([t for t in tokens if t != 2])


def schema_spec(schema: dict) -> GrammarSpec:
    fmt = common_pb2.ResponseFormat(json_schema=common_pb2.JsonSchemaFormat(schema_json=json.dumps(schema)))
    spec = grammar_spec_from_proto(fmt)
    assert spec is not None
    return spec


def generate_all(
    engine: EngineCore,
    compiler: GrammarCompiler,
    specs: dict[str, GrammarSpec],
    seeds: range = FEW_SEEDS,
    **sampling: object,
) -> dict[str, list[RequestOutput]]:
    for name, spec in specs.items():
        for seed in seeds:
            grammar = RequestGrammar.create(compiler, spec)
            engine.add_request(make_request(f"{name}/{seed}", grammar, seed, **sampling))  # type: ignore[arg-type]
    return run(engine)


# ------------------------------------------------------------------- outputs follow the grammar


@pytest.mark.timeout(900)
def test_every_json_schema_output_validates(model_dir: Path, compiler: GrammarCompiler, tokenizer: Tokenizer):
    engine = make_engine(model_dir, compiler)
    results = generate_all(engine, compiler, {name: schema_spec(s) for name, s in SCHEMAS.items()}, SEEDS)
    assert len(results) == len(SCHEMAS) * len(SEEDS)
    for request_id, outputs in results.items():
        schema = SCHEMAS[request_id.split("/")[0]]
        assert outputs[-1].finish_reason == common_pb2.FINISH_REASON_STOP, request_id
        document = json.loads(text_of(outputs, tokenizer))
        jsonschema.validate(document, schema)
    engine.scheduler.check_invariants()


def test_without_the_grammar_the_tiny_model_emits_no_json(
    model_dir: Path, compiler: GrammarCompiler, tokenizer
):
    """The control: the same seeds unconstrained never produce valid output, so the test above can fail."""
    engine = make_engine(model_dir, compiler)
    for seed in FEW_SEEDS:
        engine.add_request(make_request(f"free/{seed}", None, seed, max_tokens=40))
    for outputs in run(engine).values():
        with pytest.raises(json.JSONDecodeError):
            json.loads(text_of(outputs, tokenizer))


def test_a_grammar_that_starts_after_a_token_leaves_the_output_free_up_to_it(
    model_dir: Path, compiler: GrammarCompiler, tokenizer: Tokenizer
):
    """A think block the prompt opened: the model reasons freely until it writes the closing token,
    and only what follows is held to the grammar. Seeded, so the free part is the free run's own."""
    free_engine = make_engine(model_dir, compiler)
    free_engine.add_request(make_request("free", None, seed=3, max_tokens=12))
    free = [t for o in run(free_engine)["free"] for t in o.new_token_ids]
    # The closing token: the first one the free run writes only once it has written two others.
    position = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    closing = free[position]

    schema = SCHEMAS["tags"]
    engine = make_engine(model_dir, compiler)
    grammar = RequestGrammar.create(compiler, schema_spec(schema), starts_after=closing)
    engine.add_request(make_request("thinks", grammar, seed=3))
    outputs = run(engine)["thinks"]
    tokens = [t for o in outputs for t in o.new_token_ids]
    assert tokens[: position + 1] == free[: position + 1], "the mask touched the free part"
    assert outputs[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    answer = [t for t in tokens[position + 1 :] if t != 2]
    jsonschema.validate(json.loads(tokenizer.decode(answer)), schema)


def test_a_grammar_waiting_for_its_start_token_replays_after_a_rewind(
    compiler: GrammarCompiler, tokenizer: Tokenizer
):
    spec = schema_spec(SCHEMAS["tags"])
    answer = tokenizer.encode('{"tags":["ab"', add_special_tokens=False).ids
    closing = 7
    assert closing not in answer
    grammar = RequestGrammar(spec, _done(compiler, spec), starts_after=closing)
    for token in (11, 12):
        grammar.accept(token)
    assert not grammar.constraining and not grammar.is_terminated
    for token in (closing, *answer):
        grammar.accept(token)
    assert grammar.constraining and grammar.num_accepted == 3 + len(answer)
    grammar.sync([11, 12])  # a preemption rewound the output into the free part
    assert not grammar.constraining and grammar.num_accepted == 2
    grammar.sync([11, 12, closing, *answer[:2]])
    fresh = RequestGrammar(spec, _done(compiler, spec))
    fresh.sync(answer[:2])
    masks = MaskBuilder(compiler.vocab_size)
    assert torch.equal(masks.build({"x": grammar})["x"], masks.build({"x": fresh})["x"])


def test_json_object_always_parses(model_dir: Path, compiler: GrammarCompiler, tokenizer: Tokenizer):
    """Any-object JSON is unbounded, so a random model may run out of tokens; what finishes parses."""
    spec = grammar_spec_from_proto(common_pb2.ResponseFormat(json_object=common_pb2.JsonObjectFormat()))
    assert spec is not None
    engine = make_engine(model_dir, compiler)
    results = generate_all(engine, compiler, {"object": spec}, max_tokens=80)
    finished = [o for o in results.values() if o[-1].finish_reason == common_pb2.FINISH_REASON_STOP]
    assert finished, "no seed closed its object within 80 tokens"
    for outputs in finished:
        assert isinstance(json.loads(text_of(outputs, tokenizer)), dict)
    for outputs in results.values():
        assert text_of(outputs, tokenizer).startswith("{")


@pytest.mark.parametrize(
    "pattern",
    [r"[A-Z][a-z]{2,8} [0-9]{1,3}(\.[0-9]{2})?", r"(yes|no|maybe)", r"[a-z]{1,6}@[a-z]{2,5}\.(com|org)"],
)
def test_regex_outputs_fullmatch(
    model_dir: Path, compiler: GrammarCompiler, tokenizer: Tokenizer, pattern: str
):
    spec = grammar_spec_from_proto(common_pb2.ResponseFormat(regex=pattern))
    assert spec is not None
    engine = make_engine(model_dir, compiler)
    for outputs in generate_all(engine, compiler, {"re": spec}).values():
        assert outputs[-1].finish_reason == common_pb2.FINISH_REASON_STOP
        assert re.fullmatch(pattern, text_of(outputs, tokenizer))


def test_ebnf_grammar(model_dir: Path, compiler: GrammarCompiler, tokenizer: Tokenizer):
    grammar = 'root ::= answer " " digit\nanswer ::= "yes" | "no"\ndigit ::= [0-9]'
    spec = grammar_spec_from_proto(common_pb2.ResponseFormat(ebnf=grammar))
    assert spec is not None
    engine = make_engine(model_dir, compiler)
    for outputs in generate_all(engine, compiler, {"ebnf": spec}).values():
        assert re.fullmatch(r"(yes|no) [0-9]", text_of(outputs, tokenizer))


def test_a_completed_grammar_ends_the_request_even_ignoring_eos(
    model_dir: Path, compiler: GrammarCompiler, tokenizer: Tokenizer
):
    engine = make_engine(model_dir, compiler)
    grammar = RequestGrammar.create(compiler, GrammarSpec("regex", "done"))
    engine.add_request(make_request("r", grammar, seed=0, max_tokens=50, ignore_eos=True))
    outputs = run(engine)["r"]
    assert outputs[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert outputs[-1].matched_stop == ""
    assert text_of(outputs, tokenizer) == "done"
    assert outputs[-1].num_completion_tokens < 50


# ------------------------------------------------------------------------------- preemption


def test_preemption_keeps_outputs_valid_and_identical(
    model_dir: Path, compiler: GrammarCompiler, tokenizer: Tokenizer
):
    """Under a KV pool too small for the batch, requests are preempted and re-prefilled; the matcher
    must resume after exactly the kept output, so seeded outputs equal the unpreempted ones."""
    specs = {name: schema_spec(SCHEMAS[name]) for name in ("person", "order_refs", "nested_list")}
    roomy = generate_all(make_engine(model_dir, compiler), compiler, specs)
    # 30 blocks (2 layers x K,V x 16 slots x 2 heads x 16 dims x 4 bytes each): one request's 308
    # tokens fit, 60 concurrent ones do not.
    tight = make_engine(model_dir, compiler, kv_cache_bytes=30 * 2 * 2 * 16 * 2 * 16 * 4)
    squeezed = generate_all(tight, compiler, specs)
    assert tight.scheduler.counts.preemptions["kv_cache"], (
        f"the pool was not tight enough: {tight.runner.num_kv_blocks} blocks"
    )
    for request_id, outputs in squeezed.items():
        text = text_of(outputs, tokenizer)
        jsonschema.validate(json.loads(text), SCHEMAS[request_id.split("/")[0]])
        assert text == text_of(roomy[request_id], tokenizer), request_id


def test_sync_replays_the_output_after_a_rewind(compiler: GrammarCompiler, tokenizer: Tokenizer):
    masks = MaskBuilder(compiler.vocab_size)
    spec = schema_spec(SCHEMAS["tags"])
    tokens = tokenizer.encode('{"tags":["ab","c', add_special_tokens=False).ids
    rewound = RequestGrammar(spec, _done(compiler, spec))
    for token in tokens:
        rewound.accept(token)
    rewound.sync(tokens[:3])
    fresh = RequestGrammar(spec, _done(compiler, spec))
    fresh.sync(tokens[:3])
    assert rewound.num_accepted == fresh.num_accepted == 3
    assert torch.equal(masks.build({"x": rewound})["x"], masks.build({"x": fresh})["x"])
    assert not torch.equal(masks.build({"x": fresh})["x"], torch.ones(compiler.vocab_size, dtype=torch.bool))


def test_batch_masks_equal_each_matchers_own_mask_and_outlive_the_next_fill(
    compiler: GrammarCompiler, tokenizer: Tokenizer
):
    masks = MaskBuilder(compiler.vocab_size)
    spec = schema_spec(SCHEMAS["tags"])
    grammars = {name: RequestGrammar(spec, _done(compiler, spec)) for name in ("start", "inside", "after")}
    for token in tokenizer.encode('{"tags":["ab', add_special_tokens=False).ids:
        grammars["inside"].accept(token)
    for token in tokenizer.encode('{"tags":["a"],"scores":[', add_special_tokens=False).ids:
        grammars["after"].accept(token)
    step = masks.start(grammars)
    assert list(step) == ["start", "inside", "after"]
    first = {name: step[name] for name in step}
    kept = {name: row.clone() for name, row in first.items()}
    for name, grammar in grammars.items():
        # llguidance's byte-per-token mask, computed apart from the packed bits we unpack.
        reference = torch.frombuffer(bytearray(grammar.matcher.compute_logit_bias()), dtype=torch.uint8) != 0
        assert torch.equal(first[name], reference[: compiler.vocab_size]), name
    assert len({tuple(row.nonzero().flatten().tolist()) for row in first.values()}) == 3
    # The next step reuses the packed buffer; the rows handed out for this one must not change.
    grammars["start"].accept(tokenizer.encode("{", add_special_tokens=False).ids[0])
    masks.start(grammars).wait()
    masks.start({"start": grammars["start"]})["start"]
    assert all(torch.equal(first[name], kept[name]) for name in first)


def _done(compiler: GrammarCompiler, spec: GrammarSpec) -> concurrent.futures.Future:
    future = compiler.new_matcher(spec)
    future.result(timeout=30)
    return future


# ------------------------------------------------------------------ readiness and failures


def test_a_request_waits_for_its_grammar_without_stalling_the_batch(
    model_dir: Path, compiler: GrammarCompiler, tokenizer: Tokenizer
):
    engine = make_engine(model_dir, compiler)
    pending: concurrent.futures.Future = concurrent.futures.Future()
    spec = GrammarSpec("regex", "(yes|no)")
    engine.add_request(make_request("slow", RequestGrammar(spec, pending), seed=1))
    engine.add_request(make_request("free", None, seed=2, max_tokens=5))
    assert engine.has_work_now()
    seen: list[str] = []
    while engine.has_work_now():
        seen += [o.request_id for o in engine.step()]
    assert seen.count("free") == 5 and "slow" not in seen
    assert engine.scheduler.get_request("slow").status == RequestStatus.WAITING  # type: ignore[union-attr]
    pending.set_result(compiler.new_matcher(spec).result(timeout=30))
    assert re.fullmatch("(yes|no)", text_of(run(engine)["slow"], tokenizer))


def test_a_grammar_that_fails_late_refuses_the_request(model_dir: Path, compiler: GrammarCompiler):
    engine = make_engine(model_dir, compiler)
    failing: concurrent.futures.Future = concurrent.futures.Future()
    engine.add_request(make_request("bad", RequestGrammar(GrammarSpec("regex", "x"), failing), seed=0))
    failing.set_exception(InvalidRequest("invalid response_format.regex: boom"))
    [output] = run(engine)["bad"]
    assert output.status == RequestStatus.FINISHED_ERROR
    assert output.error == "invalid response_format.regex: boom"
    engine.scheduler.check_invariants()


def test_a_grammar_failing_between_reap_and_schedule_is_never_scheduled(
    model_dir: Path, compiler: GrammarCompiler
):
    # step() reaps failed grammars, then schedules; a compile (on its own thread) can fail in between.
    engine = make_engine(model_dir, compiler)
    failing: concurrent.futures.Future = concurrent.futures.Future()
    engine.add_request(make_request("bad", RequestGrammar(GrammarSpec("regex", "x"), failing), seed=0))
    engine._reap_failed_grammars()
    failing.set_exception(InvalidRequest("invalid response_format.regex: boom"))
    assert engine.scheduler.schedule().is_empty
    assert engine.has_work_now()
    [output] = run(engine)["bad"]
    assert output.status == RequestStatus.FINISHED_ERROR and output.error.endswith("boom")


@pytest.mark.parametrize(
    ("response_format", "message"),
    [
        (
            common_pb2.ResponseFormat(json_schema=common_pb2.JsonSchemaFormat(schema_json="{nope")),
            "not valid JSON",
        ),
        (
            common_pb2.ResponseFormat(json_schema=common_pb2.JsonSchemaFormat(schema_json="[1]")),
            "JSON object",
        ),
        (
            common_pb2.ResponseFormat(
                json_schema=common_pb2.JsonSchemaFormat(schema_json='{"type": "strin"}')
            ),
            "strin",
        ),
        (
            common_pb2.ResponseFormat(
                json_schema=common_pb2.JsonSchemaFormat(
                    schema_json='{"properties": {"a": {"$ref": "#/$defs/missing"}}}'
                )
            ),
            "/$defs/missing",
        ),
        (common_pb2.ResponseFormat(regex="[a-z"), "unclosed character class"),
        (common_pb2.ResponseFormat(regex="(?<=a)b"), "look-around"),
        (common_pb2.ResponseFormat(ebnf='root ::= "a" | b'), "Rule 'b' not found"),
        (common_pb2.ResponseFormat(regex=""), "must not be empty"),
    ],
)
def test_invalid_grammars_name_what_is_wrong(
    compiler: GrammarCompiler, response_format: common_pb2.ResponseFormat, message: str
):
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        spec = grammar_spec_from_proto(response_format)
        assert spec is not None
        compiler.new_matcher(spec).result(timeout=30)


def test_compiles_are_cached_by_schema_content(compiler: GrammarCompiler):
    first = schema_spec({"type": "object", "properties": {"a": {"type": "integer"}}})
    respaced = GrammarSpec("json_schema", first.text)
    assert compiler.compile(first) is compiler.compile(respaced)
    assert compiler.compile(first).result(timeout=30).grammar
    # Property order is generation order, so it is part of the key.
    ab = schema_spec({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}})
    ba = schema_spec({"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}})
    assert ab.key != ba.key


def test_text_format_means_no_grammar():
    assert grammar_spec_from_proto(common_pb2.ResponseFormat()) is None
    assert grammar_spec_from_proto(common_pb2.ResponseFormat(text=common_pb2.TextFormat())) is None


# Two alternatives a document can match both of: llguidance decodes oneOf as anyOf.
ONE_OF_PET = {
    "type": "object",
    "properties": {
        "pet": {
            "oneOf": [
                {"type": "object", "properties": {"cat": {"const": 1}}, "required": ["cat"]},
                {"type": "object", "properties": {"dog": {"const": 2}}, "required": ["dog"]},
            ]
        }
    },
    "required": ["pet"],
}


@pytest.mark.parametrize("strict", [False, True])
def test_one_of_is_decoded_as_any_of_even_under_strict(compiler: GrammarCompiler, strict: bool):
    # Refused before ("Enable 'coerce_one_of'"); the router checks the finished answer against the
    # whole schema (cachet.router.answer_check), so strict need not refuse the approximation.
    fmt = common_pb2.ResponseFormat(
        json_schema=common_pb2.JsonSchemaFormat(schema_json=json.dumps(ONE_OF_PET), strict=strict)
    )
    spec = grammar_spec_from_proto(fmt)
    assert spec is not None
    assert compiler.compile(spec).result(timeout=30).grammar


# What llguidance can only leave out of a grammar: the four JSONSchemaBench sample schemas it
# declined (docs/benchmarks.md, "Schema coverage") used one each.
LEFT_OUT = {
    "datetime": ({"type": "string", "format": "datetime"}, "Unknown format: datetime"),
    "jsonpath": ({"type": "string", "format": "jsonpath"}, "Unknown format: jsonpath"),
    "not": ({"type": "string", "not": {"const": "x"}}, 'Unimplemented keys: ["not"]'),
    "dependencies": (
        {"type": "object", "dependencies": {"a": ["b"]}},
        'Unimplemented keys: ["dependencies"]',
    ),
}


def json_schema_spec(schema: dict, strict: bool) -> GrammarSpec:
    fmt = common_pb2.ResponseFormat(
        json_schema=common_pb2.JsonSchemaFormat(schema_json=json.dumps(schema), strict=strict)
    )
    spec = grammar_spec_from_proto(fmt)
    assert spec is not None
    return spec


@pytest.mark.parametrize("name", LEFT_OUT)
def test_what_the_grammar_leaves_out_compiles_leniently_unless_strict(compiler: GrammarCompiler, name: str):
    fragment, warning = LEFT_OUT[name]
    schema = {"type": "object", "properties": {"x": fragment}, "required": ["x"]}
    assert compiler.compile(json_schema_spec(schema, strict=False)).result(timeout=30).grammar
    with pytest.raises(InvalidRequest) as refused:
        compiler.compile(json_schema_spec(schema, strict=True)).result(timeout=30)
    assert str(refused.value) == f"response_format.json_schema.schema uses unsupported features: {warning}"


def test_strict_names_every_unsupported_feature_at_once(compiler: GrammarCompiler):
    schema = {"type": "object", "properties": {name: LEFT_OUT[name][0] for name in LEFT_OUT}}
    with pytest.raises(InvalidRequest) as refused:
        compiler.compile(json_schema_spec(schema, strict=True)).result(timeout=30)
    for _, warning in LEFT_OUT.values():
        assert warning in str(refused.value)


def test_lenient_decoding_still_refuses_what_is_wrong(compiler: GrammarCompiler):
    # Lenient ignores what llguidance does not implement, not what is broken.
    for schema, message in [
        ({"type": "strin", "format": "datetime"}, "strin"),
        ({"type": "string", "format": "datetime", "pattern": "(?<=a)b"}, "look-around"),
    ]:
        with pytest.raises(InvalidRequest, match=re.escape(message)):
            compiler.compile(json_schema_spec(schema, strict=False)).result(timeout=30)


# Unknown formats decode as plain strings; the keywords beside them still bind.
UNKNOWN_FORMATS = {
    "type": "object",
    "properties": {
        "when": {"type": "string", "format": "datetime", "maxLength": 8},
        "path": {"type": "string", "format": "jsonpath", "pattern": "^[$](\\.[a-z]{1,4}){1,3}$"},
    },
    "required": ["when", "path"],
    "additionalProperties": False,
}


def test_a_schema_with_unknown_formats_generates_valid_json(
    model_dir: Path, compiler: GrammarCompiler, tokenizer: Tokenizer
):
    engine = make_engine(model_dir, compiler)
    results = generate_all(engine, compiler, {"event": json_schema_spec(UNKNOWN_FORMATS, strict=False)})
    assert len(results) == len(FEW_SEEDS)
    for request_id, outputs in results.items():
        assert outputs[-1].finish_reason == common_pb2.FINISH_REASON_STOP, request_id
        document = json.loads(text_of(outputs, tokenizer))
        jsonschema.validate(document, UNKNOWN_FORMATS)
    engine.scheduler.check_invariants()
