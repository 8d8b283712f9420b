"""Program execution on a fake backend: text, roles, variables, forks, errors, streaming."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

import sgrt
from sgrt.errors import GrammarError, InvalidRequest, RequestAborted

from .fake_backend import DEFAULT_SYSTEM, FakeBackend


@pytest.fixture
def fake():
    return FakeBackend(responder=lambda prompt, params: "ANSWER")


def test_text_and_variables(fake):
    @sgrt.function
    def prog(s, q):
        s += "Q: " + q + "\nA: " + sgrt.gen("a", max_tokens=3) + "\n"
        s += 7
        s += True

    st = prog.run(q="why?", backend=fake)
    assert st["a"] == "ANS"
    assert st.text() == "Q: why?\nA: ANS\n7True"
    assert "a" in st and "zzz" not in st
    assert fake.calls[0][1] == "Q: why?\nA: "
    assert fake.calls[0][2]["temperature"] == 0.0  # greedy by default
    assert st.get_meta_info("a")["finish_reason"] == {"type": "length", "length": 3}


def test_run_options_inherit_and_gen_overrides(fake):
    @sgrt.function
    def prog(s):
        s += sgrt.gen("a") + sgrt.gen("b", temperature=0.3, max_tokens=2)

    prog.run(backend=fake, temperature=0.9, max_new_tokens=5).sync()
    (_, _, pa), (_, _, pb) = fake.calls
    assert (pa["temperature"], pa["max_tokens"]) == (0.9, 5)
    assert (pb["temperature"], pb["max_tokens"]) == (0.3, 2)


def test_unknown_run_keyword_is_type_error(fake):
    @sgrt.function
    def prog(s, q):
        s += q

    with pytest.raises(TypeError):
        prog.run(q="x", temprature=0.2, backend=fake)
    with pytest.raises(TypeError):
        prog.run(backend=fake)  # missing q


def test_roles_messages_and_default_system(fake):
    @sgrt.function
    def chat(s):
        s += sgrt.user("Hi")
        s += sgrt.assistant(sgrt.gen("r1", max_tokens=6))
        with s.user():
            s += "More"
        with s.assistant():
            s += sgrt.gen("r2", max_tokens=2)

    st = chat.run(backend=fake)
    msgs = st.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[0]["content"] == DEFAULT_SYSTEM
    assert msgs[2]["content"] == "ANSWER" and msgs[4]["content"] == "AN"
    assert st.text().startswith("<|im_start|>system\n" + DEFAULT_SYSTEM + "<|im_end|>\n")
    assert fake.calls[0][1].endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_explicit_system_replaces_default(fake):
    @sgrt.function
    def chat(s):
        s += sgrt.system("Be brief.")
        s += sgrt.user("Hi")

    msgs = chat.run(backend=fake).messages()
    assert msgs[0] == {"role": "system", "content": "Be brief."}
    assert len(msgs) == 2


def test_role_begin_end_markers(fake):
    @sgrt.function
    def chat(s):
        s += sgrt.user_begin() + "x" + sgrt.user_end()

    assert chat.run(backend=fake).messages()[-1] == {"role": "user", "content": "x"}


def test_nested_roles_fail_from_text(fake):
    @sgrt.function
    def bad(s):
        with s.user():
            s += sgrt.assistant("x")

    st = bad.run(backend=fake)
    with pytest.raises(InvalidRequest):
        st.text()
    assert isinstance(st.error(), InvalidRequest)


def test_var_scope(fake):
    @sgrt.function
    def prog(s):
        s += "{"
        with s.var_scope("obj"):
            s += '"k": ' + sgrt.gen("v", max_tokens=3)
        s += "}"

    st = prog.run(backend=fake)
    assert st["obj"] == '"k": ANS'


def test_select_records_decision_and_scores(fake):
    fake.choice_logprobs = {"yes": [-0.1], "no": [-2.0]}

    @sgrt.function
    def prog(s):
        s += "Answer: " + sgrt.select("ans", ["yes", "no"]) + "."

    st = prog.run(backend=fake)
    assert st["ans"] == "yes"
    assert st.text() == "Answer: yes."
    meta = st.get_meta_info("ans")
    assert meta["normalized_prompt_logprobs"] == [-0.1, -2.0]
    assert meta["input_token_logprobs"][0][0][0] == -0.1
    assert fake.kinds() == ["select"]


def test_select_unconditional_method(fake):
    fake.choice_logprobs = {"a": [-1.0, -1.0], "b": [-0.5]}

    @sgrt.function
    def prog(s):
        s += sgrt.gen("c", choices=["a", "b"],
                      choices_method=sgrt.unconditional_likelihood_normalized)

    # a: (-1 + (-1 + 2)) / 2 = 0 ; b: -0.5  -> a
    assert prog.run(backend=fake)["c"] == "a"


def test_n_samples_gives_a_list(fake):
    @sgrt.function
    def prog(s):
        s += sgrt.gen("x", n=3, max_tokens=2, temperature=0.5)

    st = prog.run(backend=fake)
    assert st["x"] == ["AN", "AN", "AN"]
    assert st.text() == "AN"


def test_dtype_gen_passes_regex_and_parses(fake):
    fake.responder = lambda prompt, params: "42"

    @sgrt.function
    def prog(s):
        s += sgrt.gen_int("n") + " " + sgrt.gen("f", dtype=float)

    st = prog.run(backend=fake)
    assert st["n"] == "42"
    assert st.get_meta_info("n")["value"] == 42
    assert st.get_meta_info("f")["value"] == 42.0
    assert fake.calls[0][2]["regex"]


# ---- fork / join ---------------------------------------------------------------------------

def test_fork_commits_prefix_and_gathers(fake):
    fake.responder = lambda prompt, params: prompt[-1]

    @sgrt.function
    def prog(s):
        s += "Shared context. "
        forks = s.fork(3)
        forks += lambda i: f"Branch {i}: "
        forks += ["a", "b", "c"]
        forks += sgrt.gen("x", max_tokens=1)
        forks.join()
        s += "done"

    st = prog.run(backend=fake)
    assert st["x"] == ["a", "b", "c"]
    assert st.text() == "Shared context. done"
    kinds = fake.kinds()
    assert kinds[0] == "fork" and fake.calls[0][1] == "Shared context. "
    assert sorted(c[1] for c in fake.calls[1:]) == [
        "Shared context. Branch 0: a", "Shared context. Branch 1: b", "Shared context. Branch 2: c"]


def test_fork_items_and_concat_join(fake):
    fake.responder = lambda prompt, params: "X"

    @sgrt.function
    def prog(s):
        s += "P:"
        forks = s.fork(2)
        forks += [" one", " two"]
        forks += sgrt.gen("g", max_tokens=1)
        assert forks[0]["g"] == "X" and len(forks) == 2
        forks.join(mode="concate_and_append")
        s += "|"

    st = prog.run(backend=fake)
    assert st.text() == "P: oneX twoX|"
    assert st["g"] == ["X", "X"]


def test_fork_list_of_wrong_length(fake):
    @sgrt.function
    def prog(s):
        forks = s.fork(2)
        forks += ["only one"]

    with pytest.raises(InvalidRequest):
        prog.run(backend=fake)


def test_fork_of_one_does_not_commit(fake):
    @sgrt.function
    def prog(s):
        s += "x"
        with s.copy() as c:
            c += " tried " + sgrt.gen("t", max_tokens=2)
        s += "!"

    st = prog.run(backend=fake)
    assert st.text() == "x!"
    assert st["t"] == ["AN"]  # joined like a fork of one (SGLang): a one-item list
    assert "fork" not in fake.kinds()


def test_join_bad_mode(fake):
    @sgrt.function
    def prog(s):
        s.fork(2).join(mode="weld")

    with pytest.raises(InvalidRequest):
        prog.run(backend=fake)


# ---- run_batch / bind / call ---------------------------------------------------------------

def test_run_batch_order_threads_and_hint(fake):
    fake.responder = lambda prompt, params: prompt.split("Q: ")[-1][:1]
    system = "You are a careful assistant who answers every question with a single letter. " * 2

    @sgrt.function
    def prog(s, sys, q):
        s += sys + "Q: " + q + " A: " + sgrt.gen("a", max_tokens=1)

    qs = [f"{c}?" for c in "abcdefgh"]
    states = prog.run_batch([{"sys": system, "q": q} for q in qs], num_threads=4,
                            progress_bar=True, backend=fake)
    assert [s["a"] for s in states] == list("abcdefgh")
    caches = [c for c in fake.calls if c[0] == "cache"]
    assert len(caches) == 1 and caches[0][1] == system + "Q: "
    assert fake.kinds()[0] == "cache"  # hinted before dispatch


def test_run_batch_keeps_failures_in_their_state(fake):
    @sgrt.function
    def prog(s, q):
        if q == "boom":
            raise ZeroDivisionError("user bug")
        s += q + sgrt.gen("a", max_tokens=2)

    states = prog.run_batch([{"q": "x"}, {"q": "boom"}, ("y",)], backend=fake)
    assert states[0]["a"] == "AN" and states[2].text() == "yAN"
    assert isinstance(states[1].error(), ZeroDivisionError)
    with pytest.raises(ZeroDivisionError):
        states[1].text()


def test_bind_and_inline_call(fake):
    @sgrt.function
    def greet(s, name):
        s += "Hello " + name + ". "

    @sgrt.function
    def prog(s, name, q):
        greet(s, name)
        s += q

    bound = prog.bind(name="Ann")
    assert bound.run(q="Hi?", backend=fake).text() == "Hello Ann. Hi?"
    with pytest.raises(TypeError):
        prog.bind(nme="x")


def test_default_backend(fake):
    @sgrt.function
    def prog(s):
        s += sgrt.gen("a", max_tokens=1)

    old = sgrt.get_default_backend()
    try:
        sgrt.set_default_backend(None)
        with pytest.raises(InvalidRequest):
            prog.run()
        sgrt.set_default_backend(fake)
        assert prog()["a"] == "A"
    finally:
        sgrt.set_default_backend(old)


# ---- errors never leave a reader blocked ---------------------------------------------------

def test_user_exception_propagates_from_run(fake):
    @sgrt.function
    def prog(s):
        s += "x"
        raise KeyError("mine")

    with pytest.raises(KeyError, match="mine"):
        prog.run(backend=fake)


def test_failed_request_surfaces_with_original_type(fake):
    @sgrt.function
    def prog(s):
        s += "a"
        s += sgrt.gen("x", max_tokens=2)
        s += sgrt.gen("y", max_tokens=2)

    fake.fail_on = "a"
    fake.fail_with = GrammarError("cannot compile", field="regex")
    st = prog.run(backend=fake)
    with pytest.raises(GrammarError):
        st["y"]
    with pytest.raises(GrammarError):
        st["x"]
    with pytest.raises(GrammarError):
        st.text()
    assert isinstance(st.error(), GrammarError)


def test_reader_of_unknown_variable_does_not_block(fake):
    @sgrt.function
    def prog(s):
        s += "x"

    st = prog.run(backend=fake)
    with pytest.raises(KeyError):
        st["never"]


def test_program_reading_failed_variable_raises_in_program(fake):
    fake.fail_on = "go"
    fake.fail_with = RuntimeError("engine down")

    @sgrt.function
    def prog(s):
        s += "go" + sgrt.gen("x", max_tokens=2)
        if s["x"] == "y":  # blocks, then raises the request's error
            s += "never"

    with pytest.raises(RuntimeError, match="engine down"):
        prog.run(backend=fake)


def test_stream_mode_user_exception_surfaces_from_readers(fake):
    @sgrt.function
    def prog(s):
        s += sgrt.gen("x", max_tokens=4)
        s["x"]  # wait for it, so that x exists before the failure
        raise ValueError("late bug")

    st = prog.run(backend=fake, stream=True)
    with pytest.raises(ValueError, match="late bug"):
        st.text()
    with pytest.raises(ValueError):
        st["not_yet_submitted"]
    assert st["x"] == "ANSW"  # produced before the failure


def test_waiting_readers_wake_on_failure(fake):
    fake.fail_on = "slow"
    fake.delay = 0.1
    fake.fail_with = RuntimeError("boom")

    @sgrt.function
    def prog(s):
        s += "slow" + sgrt.gen("x", max_tokens=2)

    st = prog.run(backend=fake)
    got = []

    def reader():
        try:
            st["x"]
        except RuntimeError as e:
            got.append(e)

    t = threading.Thread(target=reader)
    t.start()
    t.join(timeout=60)  # a bound on a hang, not a speed check
    assert not t.is_alive() and got and str(got[0]) == "boom"


def test_abort_surfaces_request_aborted(fake):
    fake.delay = 0.05

    @sgrt.function
    def prog(s):
        s += sgrt.gen("x", max_tokens=8)

    st = prog.run(backend=fake, stream=True)
    time.sleep(0.02)
    st.abort()
    with pytest.raises(RequestAborted):
        st.text()


# ---- streaming -----------------------------------------------------------------------------

def test_text_iter_whole_and_variable(fake):
    fake.responder = lambda prompt, params: "abcdef"

    @sgrt.function
    def prog(s):
        s += "Q " + sgrt.gen("a", max_tokens=6) + " | " + sgrt.gen("b", max_tokens=3)

    st = prog.run(backend=fake, stream=True)
    assert "".join(st.text_iter()) == "Q abcdef | abc"

    fake.gate = threading.Semaphore(0)  # one chunk (two characters) per release
    st = prog.run(backend=fake, stream=True)
    it = st.text_iter("a")
    fake.gate.release()
    assert next(it) == "ab"  # the first chunk arrives before the rest exists
    assert st.executor.variables["a"] == "ab"
    fake.gate.release(10)
    assert "ab" + "".join(it) == "abcdef"
    assert list(st.text_iter("b")) and st["b"] == "abc"


def test_text_iter_without_stream_yields_once(fake):
    @sgrt.function
    def prog(s):
        s += sgrt.gen("a", max_tokens=2)

    st = prog.run(backend=fake)
    assert list(st.text_iter()) == ["AN"]
    assert list(st.text_iter("a")) == ["AN"]


def test_text_iter_unknown_variable_raises(fake):
    @sgrt.function
    def prog(s):
        s += sgrt.gen("a", max_tokens=2)

    st = prog.run(backend=fake, stream=True)
    with pytest.raises(KeyError):
        list(st.text_iter("nope"))


def test_text_async_iter_with_logprobs(fake):
    fake.responder = lambda prompt, params: "hello world"

    @sgrt.function
    def prog(s):
        s += "Say: " + sgrt.gen("a", max_tokens=11, return_logprob=True)

    async def consume():
        st = prog.run(backend=fake, stream=True)
        out = []
        async for chunk, meta in st.text_async_iter("a", return_meta_data=True):
            out.append((chunk, meta))
        return out

    out = asyncio.run(consume())
    assert "".join(c for c, _ in out) == "hello world"
    total = 0
    for chunk, meta in out:
        lps = meta.get("output_token_logprobs", [])
        assert [t for _, t, _ in lps] == meta["output_token_ids"]
        assert "".join(x for _, _, x in lps) == chunk
        total += len(lps)
        assert meta["completion_tokens"] == total
    assert out[-1][1]["finish_reason"] == {"type": "stop", "matched": None}


def test_text_async_iter_whole_text(fake):
    @sgrt.function
    def prog(s):
        s += "A" + sgrt.gen("a", max_tokens=3)

    async def consume():
        st = prog.run(backend=fake, stream=True)
        return [c async for c in st.text_async_iter()]

    assert "".join(asyncio.run(consume())) == "AANS"
