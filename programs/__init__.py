"""Reusable prompt programs: each module defines one documented ``@sgrt.function``.

``sgrt serve --programs programs/`` registers every program found here (by function name);
Python code imports them as ``from programs.extract import extract``. Programs never execute
code they are sent: tools are Python callables the caller passes in (or the defaults a
program defines), and a server client can only pass plain JSON arguments.

==========================  ===================================================================
``chat``                    multi-turn chat; later turns reuse earlier ones from the prefix cache
``extract``                 text to JSON under a JSON Schema (constrained decoding)
``classify``                few-shot ``select`` over labels (scored by log-probabilities)
``react``                   ReAct loop: thought, action as JSON under a schema, tool call, step limit
``tool_use``                one function call under a union (``anyOf``) of tool schemas
``parallel_judge``          fork N sampled candidate answers, then ``select`` the best
``skeleton_of_thought``     outline under a regex, fork one expansion per point, join
``echo_summary``            one-sentence summary (the session server's test program)
==========================  ===================================================================
"""
