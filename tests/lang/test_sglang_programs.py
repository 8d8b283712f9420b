"""Programs written the way SGLang's examples, tests and benchmarks write them, run with
``import sgrt as sgl`` (issue 19: SGLang parity; issue 44: what programs read back from the
state and the meta info).

One program per API point SGLang programs use (``forks[i] += ...`` in six program shapes, the
``gen`` / ``fork`` / ``function`` keywords, the module paths, the runtime's attributes,
reasoning separation, multimodal refusal, and at the end the shapes of issue 44: prompt
log-probabilities, ``s.copy()``, ``finish_reason``, custom choices methods, ``select``'s meta
keys, ``trace()``'s graph). Each asserts structure (types, lengths, choices, regex matches,
streams, SGLang's shapes), not what the 135M model knows. The model is the session's
(``tests/conftest.py``); every gen is short.
"""
from __future__ import annotations

import asyncio
import json
import re
import urllib.request
import warnings
from enum import Enum

import pytest

import sgrt as sgl
from sgrt.errors import InvalidRequest
from sgrt.lang.choices import ChoicesDecision, ChoicesSamplingMethod  # SGLang's module path


@pytest.fixture(autouse=True)
def default_backend(runtime):
    """What an SGLang program does first: ``sgl.set_default_backend(sgl.Runtime(...))``."""
    sgl.set_default_backend(runtime)
    yield runtime
    sgl.set_default_backend(runtime)


def _is_logprob_entry(entry, with_text=True) -> bool:
    lp, tid, text = entry
    ok = isinstance(lp, float) and lp <= 0 and isinstance(tid, int)
    return ok and (isinstance(text, str) if with_text else text is None)


# ---- the six fork shapes that assign to forks[i] -------------------------------------------

@sgl.function
def parallel_decoding(s, topic, num_points):
    """Skeleton of thought: a skeleton, then each point expanded in its own branch."""
    s += "Here is a short list of tips about " + topic + ".\n"
    for i in range(num_points):
        s += f"{i + 1}." + sgl.gen(f"point_{i}", max_tokens=6, stop=["\n"]) + "\n"
    forks = s.fork(num_points)
    for i in range(num_points):
        forks[i] += f"Now expand tip {i + 1} in one sentence:\n"
        forks[i] += sgl.gen("detailed_tip", max_tokens=8, stop=["\n\n"])
    forks.join()
    s += "Summary:\n"
    for i in range(num_points):
        s += f"{i + 1}." + forks[i]["detailed_tip"] + "\n"
    s += "In short," + sgl.gen("summary", max_tokens=4)


def test_parallel_decoding(runtime):
    st = parallel_decoding.run(topic="sleeping well", num_points=2)
    tips = st["detailed_tip"]
    assert isinstance(tips, list) and len(tips) == 2 and all(isinstance(t, str) for t in tips)
    text = st.text()
    for i, tip in enumerate(tips):
        assert f"{i + 1}.{tip}\n" in text  # the program read forks[i]["detailed_tip"]
    assert text.endswith("In short," + st["summary"])


@sgl.function
def multi_stage_fork(s, question):
    s += "Question: " + question + "\n"
    forks = s.fork(2)
    for i in range(2):
        forks[i] += f"Idea {i + 1}:" + sgl.gen("idea", max_tokens=6, stop="\n")
    forks.join()
    s += "Ideas: " + " / ".join(s["idea"]) + "\n"
    forks = s.fork(2)  # second stage, from the text that includes the first stage's results
    for i in range(2):
        forks[i] += f"Critique of idea {i + 1}:"
        forks[i] += sgl.gen("critique", max_tokens=6, stop="\n")
    forks.join()
    s += "Best idea:" + sgl.select("best", choices=["1", "2"])


def test_multi_stage_fork(runtime):
    st = multi_stage_fork.run(question="How can I learn to cook?")
    assert len(st["idea"]) == 2 and len(st["critique"]) == 2
    assert all(isinstance(x, str) and "\n" not in x for x in st["idea"] + st["critique"])
    assert st["best"] in ("1", "2")
    assert "Ideas: " + " / ".join(st["idea"]) + "\n" in st.text()


@sgl.function
def cot_decoding(s, question, get_top_k):
    """CoT decoding: branch on the k most likely first tokens, then continue each greedily."""
    s += "Question: " + question + "\nAnswer:"
    s += sgl.gen("get_top_k", max_tokens=0, return_logprob=True, top_logprobs_num=get_top_k,
                 return_text_in_logprobs=True)
    logprobs = s.get_meta_info("get_top_k")["output_top_logprobs"][0]
    forks = s.fork(get_top_k)
    for idx, (_, token) in enumerate(zip(forks, logprobs)):
        logprob, token_id, text = token
        forks[idx] += text
        forks[idx] += sgl.gen("answer", max_tokens=6, return_logprob=True, top_logprobs_num=2,
                              return_text_in_logprobs=True)
    forks.join()


def test_cot_decoding_top_k_first_tokens(runtime):
    k = 3
    st = cot_decoding.run(question="What is 2 plus 3?", get_top_k=k)
    assert st["get_top_k"] == ""  # max_tokens=0 generates nothing
    meta = st.get_meta_info("get_top_k")
    assert meta["completion_tokens"] == 0 and meta["output_token_logprobs"] == []
    top = meta["output_top_logprobs"]
    assert len(top) == 1 and len(top[0]) == k
    assert all(_is_logprob_entry(e) for e in top[0])
    assert [e[0] for e in top[0]] == sorted((e[0] for e in top[0]), reverse=True)
    assert len({e[1] for e in top[0]}) == k
    assert len(st["answer"]) == k
    for i, answer_meta in enumerate(st.get_meta_info("answer")):
        assert all(_is_logprob_entry(e) for e in answer_meta["output_token_logprobs"])
        assert all(len(row) == 2 for row in answer_meta["output_top_logprobs"])
    assert st.text().endswith("Answer:")  # the parent's text is unchanged by the branches


@sgl.function
def react(s, question):
    """ReAct: each step's thought runs in a one-branch fork; Python reads it and decides."""
    s += "Answer the question by thinking and acting.\nQuestion: " + question + "\n"
    for i in range(1, 3):
        forks = s.fork(1)
        forks[0] += f"Thought {i}:" + sgl.gen("thought", max_tokens=8, stop="\n")
        thought = forks[0]["thought"]
        s += f"Thought {i}:" + thought + "\n"
        s += f"Action {i}: " + sgl.select(f"action_{i}", choices=["Search", "Finish"])
        if s[f"action_{i}"] == "Finish":
            break
        s += "[" + sgl.gen(f"query_{i}", max_tokens=6, stop="]") + "]\n"
        s += f"Observation {i}: nothing found.\n"
    s += "Answer:" + sgl.gen("answer", max_tokens=6, stop="\n")


def test_react(runtime):
    st = react.run(question="Which country is Helsinki in?")
    actions = [st[f"action_{i}"] for i in (1, 2) if f"action_{i}" in st]
    assert 1 <= len(actions) <= 2 and all(a in ("Search", "Finish") for a in actions)
    assert actions[:-1] == ["Search"] * (len(actions) - 1)  # only the last may be Finish
    assert "\n" not in st["answer"]
    assert st.text().endswith("Answer:" + st["answer"])


@sgl.function
def llm_judge(s, question, answer):
    dimensions = ["Accuracy", "Clarity", "Depth"]
    s += "Question: " + question + "\nAnswer: " + answer + "\n"
    forks = s.fork(len(dimensions))
    for i in range(len(dimensions)):
        forks[i] += "Judge the answer's " + dimensions[i] + " in one sentence: "
        forks[i] += sgl.gen("judgement", max_tokens=6, stop="\n")
    forks.join()
    s += "Judgements:\n" + "\n".join(
        f"{d}: {j}" for d, j in zip(dimensions, s["judgement"])) + "\n"
    s += "Overall score (1-5): " + sgl.gen("score", regex=r"[1-5]")


def test_llm_judge(runtime):
    st = llm_judge.run(question="What is the boiling point of water?", answer="100 C at sea level.")
    assert len(st["judgement"]) == 3 and all(isinstance(j, str) for j in st["judgement"])
    assert re.fullmatch(r"[1-5]", st["score"])


@sgl.function
def multi_chain_reasoning(s, question, num_chains):
    s += "Question: " + question + "\n"
    forks = s.fork(num_chains)
    for i in range(num_chains):
        forks[i] += f"Reasoning {i + 1}: Let's think step by step."
        forks[i] += sgl.gen("chain", max_tokens=8, temperature=0.3, seed=i, stop="Answer:")
    forks.join()
    s += "Here are " + str(num_chains) + " lines of reasoning:\n"
    for i in range(num_chains):
        s += f"{i + 1}. {forks[i]['chain']}\n"
    s += "So the answer is:" + sgl.gen("answer", max_tokens=6, stop="\n")


def test_multi_chain_reasoning(runtime):
    st = multi_chain_reasoning.run(question="A pen costs 2 dollars. How much are 3 pens?",
                                   num_chains=3)
    chains = st["chain"]
    assert len(chains) == 3 and all("Answer:" not in c for c in chains)
    for i, c in enumerate(chains):
        assert f"{i + 1}. {c}\n" in st.text()


def test_fork_group_refuses_replacing_a_branch(runtime):
    @sgl.function
    def prog(s):
        s += "x"
        forks = s.fork(2)
        forks[0] = forks[1]

    with pytest.raises(TypeError, match="forks\\[i\\] \\+="):
        prog.run()


# ---- gen / fork / function keywords ---------------------------------------------------------

@sgl.function
def logprob_text(s, with_text):
    s += "The sky is"
    s += sgl.gen("color", max_tokens=4, return_logprob=True, top_logprobs_num=2,
                 return_text_in_logprobs=with_text)


def test_return_text_in_logprobs(runtime):
    st = logprob_text.run(with_text=True)
    meta = st.get_meta_info("color")
    entries = meta["output_token_logprobs"]
    assert len(entries) == meta["completion_tokens"] and all(_is_logprob_entry(e) for e in entries)
    assert "".join(e[2] for e in entries) == st["color"]
    st = logprob_text.run(with_text=False)  # SGLang's shape without text: None
    meta = st.get_meta_info("color")
    assert all(_is_logprob_entry(e, with_text=False) for e in meta["output_token_logprobs"])
    assert all(_is_logprob_entry(e, with_text=False) for row in meta["output_top_logprobs"] for e in row)


@sgl.function
def stop_at_regex(s):
    s += "Three words: "
    # The regex constraint forces a space after the first word, so the stop regex must fire.
    s += sgl.gen("words", regex=r"[a-z]{2,6} [a-z]{2,6} [a-z]{2,6}", stop_regex=r"[a-z] ",
                 max_tokens=16)
    s += "|" + sgl.gen("free", max_tokens=3, stop_regex=[r"\d{4}", r"QQQ"])


def test_stop_regex(runtime):
    st = stop_at_regex.run()
    words = st["words"]
    assert re.fullmatch(r"[a-z]{2,6} ", words)  # ends at the end of the first match
    meta = st.get_meta_info("words")
    assert meta["finish_reason"] == {"type": "stop", "matched": r"[a-z] "}
    assert meta["completion_tokens"] == len(meta["output_token_ids"]) >= 1
    assert st.text() == "Three words: " + words + "|" + st["free"]
    free_meta = st.get_meta_info("free")
    if free_meta["finish_reason"]["type"] == "length":
        assert not re.search(r"\d{4}|QQQ", st["free"])
    # Streamed, the pieces add up to the cut text.
    st = stop_at_regex.run(stream=True)
    pieces = list(st.text_iter("words"))
    assert "".join(pieces) == st["words"] and re.fullmatch(r"[a-z]{2,6} ", st["words"])
    st.sync()
    with pytest.raises(InvalidRequest) as e:
        sgl.gen("x", stop_regex="(unclosed")
    assert e.value.field == "stop_regex"


def test_fork_position_ids_offset(runtime):
    @sgl.function
    def branches(s):
        s += "Name a color:"
        forks = s.fork(2, position_ids_offset=[0, 0])
        forks += sgl.gen("color", max_tokens=3)
        forks.join()
        with s.copy(position_ids_offset=None) as c:
            c += " and"

    st = branches.run()
    assert len(st["color"]) == 2

    @sgl.function
    def bad(s):
        s += "x"
        s.fork(2, position_ids_offset=[0])

    with pytest.raises(InvalidRequest) as e:
        bad.run()
    assert e.value.field == "position_ids_offset"


@sgl.function(num_api_spec_tokens=64)
def spec_program(s, topic):
    s += "Topic: " + topic + "\nTitle:" + sgl.gen("title", max_tokens=6, stop="\n")
    s += "\nFirst line:" + sgl.gen("line", max_tokens=6, stop="\n")


def test_num_api_spec_tokens_accepted_same_output(runtime):
    assert spec_program.num_api_spec_tokens == 64
    plain = sgl.function(spec_program.func)
    a, b = spec_program.run(topic="rivers"), plain.run(topic="rivers")
    assert a.text() == b.text()  # accepted, no effect (greedy: identical text)
    with pytest.raises(InvalidRequest):
        sgl.function(num_api_spec_tokens=-1)


def test_flush_cache_empty_cache(runtime):
    @sgl.function
    def prog(s):
        s += "A fairly long constant prompt that the radix cache will keep around: " * 2
        s += sgl.gen("x", max_tokens=2)

    assert sgl.flush_cache(runtime, empty_cache=False) is None
    # run() returns before its gens finish (SGLang's executor thread); sync() waits, so the
    # second run starts after the first one's prefix is in the cache.
    prog.run().sync()
    second = prog.run().get_meta_info("x")
    assert second["cached_tokens"] > 0, (second, runtime.engine.stats())
    assert sgl.flush_cache(empty_cache=True) is None
    assert prog.run().get_meta_info("x")["cached_tokens"] == 0
    sgl.set_default_backend(None)
    assert sgl.flush_cache() is False and sgl.get_server_info() is None  # SGLang's no-backend answers


def test_runtime_endpoint_verify_and_chat_template_name(runtime):
    backend = sgl.RuntimeEndpoint(runtime.url, verify=False, chat_template_name="chatml")
    try:
        @sgl.function
        def chat(s, q):
            s += sgl.user(q)
            s += sgl.assistant(sgl.gen("a", max_tokens=4, stop_regex=r"\s"))

        st = chat.run(q="Say hi.", backend=backend)
        # chatml by name: no default system message (the model's own template has one).
        assert st.text().startswith("<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n")
        assert [m["role"] for m in st.messages()] == ["user", "assistant"]
        meta = st.get_meta_info("a")
        if meta["finish_reason"]["type"] == "stop":
            assert re.search(r"\s", st["a"]) and not re.search(r"\s", st["a"][:-1])
        assert backend.url == runtime.url and backend.endpoint is backend
        assert isinstance(backend.model_info["model_path"], str)
    finally:
        backend.shutdown()
    with pytest.raises(InvalidRequest) as e:
        sgl.RuntimeEndpoint(runtime.url, chat_template_name="no-such-template")
    assert e.value.field == "chat_template_name"


def test_runtime_model_path(loaded_model):
    rt = sgl.Runtime(model_path=loaded_model, max_total_tokens=512, log_level="error")
    try:
        @sgl.function
        def prog(s):
            s += "Hello" + sgl.gen("x", max_tokens=2)

        assert isinstance(prog.run(backend=rt)["x"], str)
    finally:
        rt.shutdown()
    with pytest.raises(InvalidRequest) as e:
        sgl.Runtime(model="a", model_path="b")
    assert e.value.field == "model_path"


# ---- module paths and names -----------------------------------------------------------------

def test_module_paths(runtime):
    from sgrt.api import function, gen, set_default_backend
    from sgrt.global_config import global_config
    from sgrt.lang.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR

    assert function is sgl.function and gen is sgl.gen
    set_default_backend(runtime)
    assert global_config is sgl.global_config and global_config.default_backend is runtime
    global_config.default_backend = None
    assert sgl.get_default_backend() is None
    global_config.default_backend = runtime
    assert re.fullmatch(REGEX_INT, "-42 ") and re.fullmatch(REGEX_FLOAT, "3.14\n")
    assert re.fullmatch(REGEX_BOOL, "True") and re.fullmatch(REGEX_STR, '"a b1"')


@sgl.function
def character_gen(s, name):
    from sgrt.lang.ir import REGEX_FLOAT, REGEX_INT, REGEX_STR

    s += name + " is a character in a book. Fill in the form.\n"
    with s.var_scope("json_output"):
        s += "{\n"
        s += '  "name": ' + sgl.gen("name", regex=REGEX_STR, max_tokens=8) + ",\n"
        s += '  "age": ' + sgl.gen("age", regex=REGEX_INT, stop=[" ", "\n"], max_tokens=3) + ",\n"
        s += '  "height": ' + sgl.gen("height", regex=REGEX_FLOAT, stop=[" ", "\n"], max_tokens=4)
        s += "\n}"


def test_json_decode_regex_constants(runtime):
    st = character_gen.run(name="Harry")
    assert st["name"].startswith('"')
    if st.get_meta_info("name")["finish_reason"]["type"] == "stop":
        assert re.fullmatch(r'"[\w\d\s]*"', st["name"])
    assert re.fullmatch(r"[-+]?[0-9]+", st["age"])
    assert re.fullmatch(r"[-+]?[0-9]*\.?[0-9]+", st["height"]) or st["height"] in ("+", "-", ".")
    out = st["json_output"]
    assert out.startswith("{\n") and out.endswith("\n}")
    if all(st.get_meta_info(k)["finish_reason"]["type"] == "stop" for k in ("name", "age", "height")):
        assert set(json.loads(out)) == {"name", "age", "height"}


def test_build_regex_from_object(runtime):
    from pydantic import BaseModel, constr

    from sgrt.srt.constrained import build_regex_from_object as from_package
    from sgrt.srt.constrained.json_schema import build_regex_from_object as from_json_schema
    from sgrt.srt.constrained.outlines_backend import build_regex_from_object

    class House(str, Enum):
        red = "Red"
        blue = "Blue"

    class Character(BaseModel):
        name: constr(max_length=8)
        house: House
        wizard: bool

    regex = build_regex_from_object(Character)
    assert from_package is build_regex_from_object and from_json_schema is build_regex_from_object
    assert re.fullmatch(regex, '{"name":"Ann","house":"Red","wizard":true}')
    assert not re.fullmatch(regex, '{"name":"Ann","house":"Green","wizard":true}')

    @sgl.function
    def character(s):
        s += "A character as JSON: " + sgl.gen("json", regex=regex, max_tokens=40)

    st = character.run()
    if st.get_meta_info("json")["finish_reason"]["type"] == "stop":
        Character.model_validate_json(st["json"])
    assert st["json"].startswith("{")


def test_function_compile(runtime):
    @sgl.function
    def two_step(s, q):
        s += "Q: " + q + "\nA:" + sgl.gen("a", max_tokens=4, stop="\n")
        s += "\nWhy:" + sgl.gen("why", max_tokens=4, stop="\n")

    compiled = two_step.compile()
    compiled.print_graph()
    st = compiled.run(q="Is ice cold?")
    assert st.text() == two_step.run(q="Is ice cold?").text()
    states = compiled.run_batch([{"q": "Is fire hot?"}, {"q": "Is snow white?"}])
    assert [isinstance(x["why"], str) for x in states] == [True, True]


def test_runtime_attributes(runtime):
    from sgrt.srt.hf_transformers_utils import get_tokenizer
    from sgrt.srt.utils.hf_transformers_utils import get_tokenizer as get_tokenizer_new

    assert get_tokenizer_new is get_tokenizer
    info = runtime.model_info
    assert info["is_generation"] is True and isinstance(info["model_path"], str) and info["model_path"]
    # test_gen_min_new_tokens's shape: the model name through the default backend's endpoint.
    model_path = sgl.global_config.default_backend.endpoint.get_model_name()
    assert model_path == info["model_path"]
    server = sgl.get_server_info()
    for key in ("model_path", "tokenizer_path", "context_length", "max_total_num_tokens", "version"):
        assert key in server
    assert isinstance(server["context_length"], int) and server["context_length"] > 0
    tokenizer = get_tokenizer(server["tokenizer_path"])
    ids = tokenizer.encode("Hello world")
    assert ids and all(isinstance(i, int) for i in ids) and tokenizer.decode(ids) == "Hello world"
    assert runtime.get_tokenizer().encode("Hello world") == ids

    @sgl.function
    def min_tokens(s):
        s += sgl.user("Say one word.")
        s += sgl.assistant(sgl.gen("answer", min_tokens=12, max_tokens=16))

    st = min_tokens.run()
    assert len(tokenizer.encode(st["answer"])) >= 10  # re-encoding may merge a token or two


def test_token_usage(runtime):
    runtime.token_usage.reset()

    @sgl.function
    def prog(s):
        s += "Count: one," + sgl.gen("a", max_tokens=3) + sgl.select("b", choices=[" x", " y"])

    st = prog.run()
    st.sync()  # the select runs after the program function returned
    meta = st.get_meta_info("a")
    usage = runtime.token_usage
    assert usage.completion_tokens == meta["completion_tokens"]
    assert usage.prompt_tokens == meta["prompt_tokens"] + sum(st.get_meta_info("b")["prompt_tokens"])
    usage.reset()
    assert (usage.prompt_tokens, usage.completion_tokens) == (0, 0)


def test_async_generate_and_url(runtime):
    async def collect():
        pieces = []
        async for piece in runtime.async_generate("The sky is", {"max_new_tokens": 4, "temperature": 0}):
            pieces.append(piece)
        return pieces

    pieces = asyncio.run(collect())
    assert pieces and all(isinstance(p, str) and p for p in pieces)
    assert runtime.endpoint is runtime
    assert runtime.url.startswith("http://127.0.0.1:") and runtime.generate_url == runtime.url + "/generate"
    with urllib.request.urlopen(runtime.url + "/v1/models", timeout=30) as resp:
        assert json.loads(resp.read())["data"]


# ---- state printing, n > 1, reasoning, multimodal -------------------------------------------

def test_repr_prints_whole_text(runtime):
    @sgl.function
    def prog(s):
        s += "A" * 80 + " then " + sgl.gen("x", max_tokens=3)

    st = prog.run()
    assert repr(st) == f"ProgramState({st.text()})" and len(st.text()) > 86


def test_n_samples_without_temperature_warn_and_sample(runtime):
    @sgl.function
    def prog(s):
        s += "A random animal:" + sgl.gen("animal", n=3, max_tokens=4)

    with pytest.warns(UserWarning, match="temperature"):
        st = prog.run()
        st.sync()
    assert isinstance(st["animal"], list) and len(st["animal"]) == 3
    assert st.text() == "A random animal:" + st["animal"][0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        greedy = prog.run(temperature=0.0)
        greedy.sync()
        assert greedy.error() is None
    assert len(set(greedy["animal"])) == 1  # explicit greedy: n identical completions


@sgl.function
def thinking(s, model_type, pattern):
    s += sgl.user("Is 7 prime?")
    s += sgl.assistant(sgl.separate_reasoning(
        sgl.gen("answer", regex=pattern, max_tokens=40), model_type=model_type))


def test_separate_reasoning(runtime):
    # Issue 44, item 7: the regex makes the model write whitespace around its thoughts and
    # before its answer; SGLang's parser strips the text, then the answer.
    st = thinking.run(model_type="qwen3", pattern=r"<think> [a-z]{2,8} </think>  [A-Z][a-z]{2,8}")
    reasoning, answer = st["answer_reasoning_content"], st["answer"]
    assert re.fullmatch(r"[a-z]{2,8} ", reasoning)  # leading space gone, trailing one kept
    assert re.fullmatch(r"[A-Z][a-z]{2,8}", answer)  # both spaces before it gone
    assert st.messages()[-1] == {"role": "assistant", "content": answer}
    assert "<think>" not in st.text() and st.text().endswith("assistant\n" + answer + "<|im_end|>\n")
    # deepseek-r1 writes its reasoning without the opening tag.
    st = thinking.run(model_type="deepseek-r1", pattern=r"\n[a-z]{2,8}\n</think>\n\n[A-Z][a-z]{2,8}")
    assert re.fullmatch(r"[a-z]{2,8}\n", st["answer_reasoning_content"])
    assert re.fullmatch(r"[A-Z][a-z]{2,8}", st["answer"])
    with pytest.raises(InvalidRequest) as e:
        sgl.separate_reasoning(sgl.gen("x"), model_type="no-such-parser")
    assert e.value.field == "model_type"


def test_split_reasoning_rules():
    from sgrt.lang.reasoning import split_reasoning

    assert split_reasoning("<think> abc </think>  Four", "qwen3") == ("abc ", "Four")
    assert split_reasoning("<think>a</think>b", "qwen3") == ("a", "b")
    assert split_reasoning("\n<think>\nx\n</think>\n\ny\n", None) == ("x\n", "y")
    assert split_reasoning("  plain answer ", "qwen3") == ("", "  plain answer ")  # not reasoning
    assert split_reasoning(" thoughts </think> answer", "deepseek-r1") == ("thoughts ", "answer")
    assert split_reasoning("<think> cut short ", None) == ("cut short", "")


@pytest.mark.parametrize("primitive", ["image", "video"])
def test_image_and_video_refused(runtime, primitive):
    @sgl.function
    def image_qa(s, path):
        media = sgl.image(path) if primitive == "image" else sgl.video(path, 4)
        s += sgl.user(media + "What is in it?")
        s += sgl.assistant(sgl.gen("answer", max_tokens=4))

    st = image_qa.run(path="example_image.png")
    with pytest.raises(InvalidRequest) as e:
        st.text()
    assert e.value.field == primitive
    assert f"sgrt.{primitive}" in str(e.value) and "vision tower" in str(e.value)


def test_next_token_request_streamed_has_the_same_top_tokens(runtime):
    # The next-token idiom through generate_stream (BaseBackend.next_token_stream): one finished
    # chunk, no text, and the same top tokens as the complete request.
    from sgrt.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=0, return_logprob=True, top_logprobs_num=3)
    whole = runtime.generate("Question: What is 2 plus 3?\nAnswer:", params)
    chunks = list(runtime.generate_stream("Question: What is 2 plus 3?\nAnswer:", params))
    assert len(chunks) == 1 and chunks[0].finished and chunks[0].text == ""
    streamed = chunks[0].meta_info["output_top_logprobs"]
    assert [e[1] for e in streamed[0]] == [e[1] for e in whole.meta_info["output_top_logprobs"][0]]
    assert len(streamed[0]) == 3


# ---- issue 44: what programs read back from the state and the meta info --------------------

@sgl.function
def prompt_logprobs(s, start, top):
    s += "The capital of France is"
    s += sgl.gen("next", max_tokens=3, return_logprob=True, logprob_start_len=start,
                 top_logprobs_num=top, return_text_in_logprobs=True)


@sgl.function
def rescore(s, text):
    s += text + sgl.gen("none", max_tokens=0, return_logprob=True, logprob_start_len=0)


def test_gen_prompt_logprobs(runtime):
    """Item 1: ``gen(return_logprob=True, logprob_start_len=0)`` gives the prompt's entries."""
    st = prompt_logprobs.run(start=0, top=0)
    meta = st.get_meta_info("next")
    entries = meta["input_token_logprobs"]
    assert len(entries) == meta["prompt_tokens"] and entries[0][0] is None  # no context at 0
    assert all(isinstance(lp, float) and lp <= 0 for lp, _, _ in entries[1:])
    assert [t for _, t, _ in entries] == runtime.encode("The capital of France is")
    assert "".join(x for _, _, x in entries) == "The capital of France is"
    # SGLang's own check: the gen's output logprobs are what scoring the whole text gives.
    out_ids = [t for _, t, _ in meta["output_token_logprobs"]]
    whole = rescore.run(text="The capital of France is" + st["next"]).get_meta_info("none")
    assert [t for _, t, _ in whole["input_token_logprobs"]] == [t for _, t, _ in entries] + out_ids
    scored = [lp for lp, _, _ in whole["input_token_logprobs"][len(entries):]]
    assert scored == pytest.approx([lp for lp, _, _ in meta["output_token_logprobs"]], abs=1e-3)
    assert [lp for lp, _, _ in whole["input_token_logprobs"][1:len(entries)]] == pytest.approx(
        [lp for lp, _, _ in entries[1:]], abs=1e-4)
    # From position 2, with the top tokens of each position.
    meta2 = prompt_logprobs.run(start=2, top=2).get_meta_info("next")
    assert [e[1:] for e in meta2["input_token_logprobs"]] == [e[1:] for e in entries[2:]]
    assert [e[0] for e in meta2["input_token_logprobs"]] == pytest.approx([e[0] for e in entries[2:]],
                                                                         abs=1e-4)
    tops = meta2["input_top_logprobs"]
    assert len(tops) == len(meta2["input_token_logprobs"]) and all(len(row) == 2 for row in tops)
    assert all(row[0][0] >= lp - 1e-5 for row, (lp, _, _) in zip(tops, meta2["input_token_logprobs"]))

    @sgl.function
    def no_start(s):
        s += "The capital of France is" + sgl.gen("next", max_tokens=2, return_logprob=True)

    meta3 = no_start.run().get_meta_info("next")
    assert meta3["input_token_logprobs"] == [] and len(meta3["output_token_logprobs"]) == 2


@sgl.function
def tried_aside(s):
    s += "A short poem about the sea:\n"
    with s.copy() as c:
        c += "First line:" + sgl.gen("extra", max_tokens=6, stop="\n")
    s += "Title:" + sgl.gen("title", max_tokens=4, stop="\n")


def test_copy_is_joined_like_a_fork(runtime):
    """Item 2: after ``with s.copy() as c``, ``s["extra"]`` is a one-item list."""
    st = tried_aside.run()
    extra = st["extra"]
    assert isinstance(extra, list) and len(extra) == 1 and isinstance(extra[0], str)
    assert st.get_meta_info("extra")[0]["completion_tokens"] >= 1
    assert st.text() == "A short poem about the sea:\nTitle:" + st["title"]  # s's text unchanged

    @sgl.function
    def fork_of_one(s):
        s += "A short poem about the sea:\n"
        forks = s.fork(1)
        forks[0] += "First line:" + sgl.gen("extra", max_tokens=6, stop="\n")
        forks.join()

    assert fork_of_one.run()["extra"] == extra  # the same thing, spelled as a fork


@sgl.function
def finish_reasons(s):
    s += "Spell a long word: " + sgl.gen("cut", max_tokens=2, regex=r"[a-z]{30}")
    # NOTE: sgrt ends a constrained gen at a stop string only where the constraint could end
    # (here after each pair), so the regex makes one of the two stops certain.
    s += "\nLetter pairs: " + sgl.gen("pairs", max_tokens=8, regex=r"(ab|cd)+", stop=["b", "d"])
    s += "\nYes or no? " + sgl.gen("yn", regex=r"(yes|no)")


def test_finish_reason_is_sglangs_dict(runtime):
    """Item 3: ``finish_reason`` is ``{"type": "stop", "matched": ...}`` or ``{"type":
    "length", "length": n}``, streamed or not."""
    for stream in (False, True):
        st = finish_reasons.run(stream=stream)
        st.sync()
        assert st.get_meta_info("cut")["finish_reason"] == {"type": "length", "length": 2}
        reason = st.get_meta_info("pairs")["finish_reason"]
        assert reason["type"] == "stop" and reason["matched"] in ("b", "d") and set(reason) == {
            "type", "matched"}
        assert re.fullmatch(r"(ab|cd)+", st["pairs"] + reason["matched"])  # cut before the stop
        assert st.get_meta_info("yn")["finish_reason"]["type"] == "stop"

    @sgl.function
    def samples(s):
        s += "Spell a long word: " + sgl.gen("w", n=2, temperature=0.0, max_tokens=3, regex=r"[a-z]{30}")

    metas = samples.run().get_meta_info("w")
    assert [m["finish_reason"] for m in metas] == [{"type": "length", "length": 3}] * 2


class LeastLikely(ChoicesSamplingMethod):
    """A method written to SGLang's call signature: the least likely option, and what it got."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None):
        worst = min(range(len(choices)), key=lambda i: normalized_prompt_logprobs[i])
        return ChoicesDecision(decision=choices[worst], meta_info={
            "received": {"input": input_token_logprobs, "output": output_token_logprobs,
                         "unconditional": unconditional_token_logprobs}})


@sgl.function
def sky_color(s, method):
    s += "The color of the clear sky at noon is"
    s += sgl.select("color", choices=[" blue", " green", " purple"], choices_method=method)


def test_custom_choices_method(runtime):
    """Item 4: a ``ChoicesSamplingMethod`` subclass written to SGLang's signature runs."""
    st = sky_color.run(method=LeastLikely())
    meta = st.get_meta_info("color")
    scores = meta["normalized_prompt_logprobs"]
    assert st["color"] == [" blue", " green", " purple"][scores.index(min(scores))]
    got = meta["received"]
    assert got["output"] == [[], [], []]
    for option, entries, alone in zip([" blue", " green", " purple"], got["input"], got["unconditional"]):
        assert "".join(x for _, _, x in entries) == option  # no token healing after "is"
        assert [t for _, t, _ in alone] == [t for _, t, _ in entries]  # the same tokens, alone
        assert alone[0][0] is None and all(lp <= 0 for lp, _, _ in alone[1:])
    assert scores == pytest.approx([sum(lp for lp, _, _ in e) / len(e) for e in got["input"]])


@sgl.function
def tool_use(s, question, method):
    s += "To answer this question: " + question + ", "
    s += "I need to use a " + sgl.gen("tool", choices=["calculator", "search engine"],
                                      choices_method=method) + ". "


def test_select_meta_keys(runtime):
    """Item 5: ``select``'s meta info keys are SGLang's, for each of the three methods."""
    q = "What is 257 times 983?"
    for method in (sgl.token_length_normalized, sgl.greedy_token_selection,
                   sgl.unconditional_likelihood_normalized):
        st = tool_use.run(question=q, method=method)
        meta = st.get_meta_info("tool")
        inputs = meta["input_token_logprobs"]
        assert len(inputs) == 2 and all(_is_logprob_entry(e) for e in inputs[0] + inputs[1])
        assert meta["output_token_logprobs"] == [[], []]
        assert meta["normalized_prompt_logprobs"] == pytest.approx(
            [sum(lp for lp, _, _ in e) / len(e) for e in inputs])
        if method is sgl.greedy_token_selection:
            width = max(len(e) for e in inputs)
            assert [len(row) for row in meta["greedy_logprob_matrix"]] == [width, width]
        if method is sgl.unconditional_likelihood_normalized:
            alone = meta["unconditional_token_logprobs"]
            assert [[t for _, t, _ in e] for e in alone] == [[t for _, t, _ in e] for e in inputs]
            expected = [sum(c - (u or 0.0) for (c, _, _), (u, _, _) in zip(e, a)) / len(e)
                        for e, a in zip(inputs, alone)]
            scores = meta["normalized_unconditional_prompt_logprobs"]
            assert scores == pytest.approx(expected)
            assert st["tool"] == ["calculator", "search engine"][scores.index(max(scores))]
        else:
            assert "unconditional_token_logprobs" not in meta


@sgl.function
def tip_suggestion(s):
    s += "Here are two tips for staying healthy: 1. Balanced Diet; 2. Regular Exercise\n"
    forks = s.fork(2)
    for i in range(2):
        forks[i] += f"Now, expand tip {i + 1} into a paragraph:\n"
        forks[i] += sgl.gen("detailed_tip", max_tokens=8)
    s += "Tip 1:" + forks[0]["detailed_tip"] + "\n"
    s += "Tip 2:" + forks[1]["detailed_tip"] + "\n"
    s += "In summary" + sgl.gen("summary", max_tokens=8)


def test_trace_graph_api(runtime):
    """Item 6: ``fn.trace().last_node.print_graph_dfs()``, as SGLang's tracing tests use it."""
    tracer = tip_suggestion.trace()
    last = tracer.last_node
    graph = last.print_graph_dfs()
    lines = graph.splitlines()
    assert isinstance(graph, str) and graph.endswith("\n")
    assert lines[-1] == f"%{last.node_id} = %{last.prev_node.node_id} + " + last.describe()
    assert "Gen('summary'" in lines[-1]
    # Both branches' gens are in it (the parent reads their variables), and every node is
    # printed after the nodes it refers to.
    assert sum("Gen('detailed_tip'" in line for line in lines) == 2
    printed: set[int] = set()
    for line in lines:
        ids = [int(x) for x in re.findall(r"%(\d+)", line)]
        assert set(ids[1:]) <= printed, line
        printed.add(ids[0])
    assert len(printed) == len(lines) == len(tracer.nodes)

    @sgl.function
    def few_shot_qa(s, question):
        s += "The following are questions with answers.\n\n"
        s += "Q: What is the capital of France?\nA: Paris\n"
        s += "Q: " + question + "\n"
        s += "A:" + sgl.gen("answer", stop="\n")

    tracer = few_shot_qa.trace()
    lines = tracer.last_node.print_graph_dfs().splitlines()
    assert len(lines) == len(tracer.nodes) and lines[0].startswith("%") and " + " not in lines[0]
    assert "Arg('question')" in lines[3] and "Gen('answer'" in lines[-1]
