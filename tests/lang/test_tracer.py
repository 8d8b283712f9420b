"""Tracing a program into a graph, and its constant prefix (no model)."""
from __future__ import annotations

import sgrt
from sgrt.lang.chat_template import CHATML

from .fake_backend import DEFAULT_SYSTEM, FakeBackend


@sgrt.function
def few_shot(s, question):
    s += "Answer briefly.\n"
    s += f"Q: {question}\nA: " + sgrt.gen("answer", max_tokens=8, stop="\n")
    s += "\nConfidence: " + sgrt.select("conf", ["high", "low"])


def test_trace_graph_nodes_and_prefix():
    t = few_shot.trace()
    kinds = [n.kind for n in t.nodes]
    assert kinds == ["text", "text", "arg", "text", "gen", "text", "select"]
    assert t.prefix == "Answer briefly.\nQ: "  # stops at the argument (f-strings work)
    assert t.complete
    graph = t.format_graph()
    assert "Gen('answer', max_tokens=8" in graph and "Arg('question')" in graph
    assert "%4 = %3 + Gen" in graph
    assert "digraph" in t.to_dot()
    edges = t.edges()
    assert (0, 1, "seq") in edges


def test_trace_with_known_argument_extends_prefix():
    t = few_shot.trace(question="Why?")
    assert t.prefix == "Answer briefly.\nQ: Why?\nA: "


def test_trace_roles_use_backend_template():
    @sgrt.function
    def chat(s, q):
        s += sgrt.system("Be brief.")
        with s.user():
            s += q
        s += sgrt.assistant(sgrt.gen("a"))

    t = chat.trace(backend=FakeBackend())
    assert t.prefix == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    assert [n.kind for n in t.nodes][:4] == ["role_begin", "text", "role_end", "role_begin"]


def test_trace_default_system_prompt_is_in_prefix():
    @sgrt.function
    def chat(s, q):
        s += sgrt.user(q)

    t = chat.trace(backend=FakeBackend())
    assert t.prefix.startswith("<|im_start|>system\n" + DEFAULT_SYSTEM)


def test_trace_stops_at_data_dependent_control_flow():
    @sgrt.function
    def react(s):
        s += "Thought: " + sgrt.select("act", ["Search", "Finish"])
        if s["act"] == "Search":
            s += "searching"

    t = react.trace()
    assert not t.complete and "act" in t.stop_reason
    assert t.nodes[-1].kind == "stop"
    assert "tracing stopped" in t.format_graph()


def test_trace_variable_reads_link_to_their_source():
    @sgrt.function
    def chain(s):
        s += "Name: " + sgrt.gen("name", max_tokens=4)
        s += "\nHello " + s["name"]

    t = chain.trace()
    var = [n for n in t.nodes if n.kind == "var"][0]
    assert var.sources and var.sources[0].kind == "gen"


def test_trace_fork_and_join():
    @sgrt.function
    def sot(s, topic):
        s += "Write about " + topic + ".\n"
        forks = s.fork(2)
        forks += lambda i: f"Point {i}: " + sgrt.gen("p", max_tokens=4)
        forks.join()
        s += "Summary: " + sgrt.gen("summary")

    t = sot.trace()
    kinds = [n.kind for n in t.nodes]
    assert kinds.count("fork") == 1 and kinds.count("join") == 1 and kinds.count("gen") == 3
    join = [n for n in t.nodes if n.kind == "join"][0]
    assert len(join.sources) == 2
    streams = {n.stream for n in t.nodes if n.kind == "gen"}
    assert len(streams) == 3
    graph = t.format_graph()
    assert "fork(2)" in graph and "join('gather_variable')" in graph


def test_cache_hints_the_prefix():
    fake = FakeBackend()

    @sgrt.function
    def prog(s, doc, q):
        s += "Document: " + doc + "\nQuestion: " + q + sgrt.gen("a")

    out = prog.bind(doc="long text " * 10).cache(backend=fake)
    assert out["prefix"] == "Document: " + "long text " * 10 + "\nQuestion: "
    assert fake.calls == [("cache", out["prefix"], {})]


def test_chatml_template_constant():
    assert CHATML.prefix_and_suffix("assistant") == ("<|im_start|>assistant\n", "<|im_end|>\n")


def test_trace_uses_default_argument_values_unless_a_batch_varies_them():
    import sgrt

    @sgrt.function
    def greet(s, name, greeting="Hello"):
        s += greeting + ", " + name + "! "
        s += sgrt.gen("reply", max_tokens=4)

    assert greet.trace().prefix == "Hello, "
    assert greet._trace(None, {}, varying={"greeting"}).prefix == ""
