"""llguidance's bounds on one grammar (``LLParserLimits``), the one definition: the frontend checks
a grammar under them before it is queued (``frontend/http/grammars.py``) and the scheduler compiles
and steps it under them (``scheduler/grammar.py``), so a grammar that passes the check compiles
there. Here because ``scheduler.messages`` is what both sides may import; llguidance is passed in,
never imported here.

Measured (llguidance 1.9.1 and 1.6.1, this CPU, the Qwen-size tokenizer of
``scripts/bench_grammar_mask.py``; the smallest limit each grammar's walk passes):

| grammar                                    | items in a row | step fuel    | step items   | states |
|--------------------------------------------|----------------|--------------|--------------|--------|
| JSON schemas, free text with calls         | <= 12          | <= 5,800     | <= 80        | <= 800 |
| a forced call of one of 100 tools          | 100            | 3,100        | 403          | 180    |
| a Lark regex ``/[a-z ]{1,200}/``           | 1              | 497          | 14,590       | 212    |
| attack: ``x: x x | x x x | /[a-z ]/ | ""`` | fails at 500   |              |              |        |
| attack: 300 overlapping regex lexemes      |                | fails: 8 ms  |              |        |

The ambiguous rule's chart row grows by a few items a token and each step costs more than the last:
at llguidance's default of 2,000 items it is past 0.5 s a step before it fails (the 1.4 s a step
reported from the GPU host); at 500 it fails after 107 tokens, its worst step 21 ms. Past a limit
the matcher is in error and its request alone fails. llguidance's other defaults: fuel 200,000 (the lexeme attack
then takes 67 ms a step), 250,000 states (~1-2 kB each).
"""
from __future__ import annotations

LIMITS = dict(
    max_items_in_row=500,  # an Earley row: the cost of a step grows with it, faster than linearly
    max_grammar_size=200_000,  # symbols in productions: a compile, not a hang
    initial_lexer_fuel=1_000_000,  # building the lexer (a 40-tool call grammar needs 4,600)
    step_lexer_fuel=50_000,  # one step's mask: 8x the heaviest ordinary grammar
    step_max_items=50_000,  # one step's Earley items: 3x a counted regex over a letter class
    max_lexer_states=50_000,  # a matcher's memory: 60x the heaviest ordinary grammar
)


def parser_limits(llguidance):
    """``LIMITS`` as the installed llguidance takes them: a field an older release lacks keeps its
    default there (1.6.1, the GPU host's, has every field above)."""
    cls = llguidance.LLParserLimits
    return cls(**{name: value for name, value in LIMITS.items() if hasattr(cls, name)})
