"""`v41 bench tools`: how well a checkpoint calls tools, on held-out conversations.

Conversations of :mod:`model.training.tool_data` in two held-out splits: ``held_out``
(modules the fine-tune never saw, training phrasings) and ``held_out_phrasing``
(held-out modules, phrasings never seen). Each assistant turn is generated greedily
by the engine from the gold history before it (teacher forcing), with the tools the
conversation offers, and scored:

- a turn that should call tools: ``well_formed`` (the answer holds a calls block that
  parses, every call's arguments a JSON object), ``right_function`` (the called
  functions are the expected ones, in order), ``valid_arguments`` (and each call's
  arguments validate against its function's schema), ``exact`` (and they equal the
  expected arguments), ``cut_at_max_tokens`` (the answer ran to the limit, 192 tokens,
  without its end token: under a grammar the only way not to be well-formed);
- a turn that should answer: ``no_call`` (it calls nothing), ``has_result`` (its text
  holds every result of the tools called just before; for a greeting, the expected
  reply), ``exact`` (the text is the expected answer).

Call turns are generated free (the model alone), constrained as ``tool_choice:
required`` is served (the grammar of a calls block over the offered tools, which makes
every call well-formed by construction) and, where the tokenizer has the ``｜DSML｜``
token, as ``tool_choice: auto`` is served: free until the model opens a calls block,
then under the same grammar (``call_auto``; a turn where the model does not call is
not well-formed).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", type=Path, default=Path("configs/small"), help="checkpoint directory")
    parser.add_argument("--n", type=int, default=100, help="conversations per split")
    parser.add_argument("--seed", type=int, default=1)


def _turns(conversations):
    """(conversation, index of an assistant message) for every assistant turn."""
    return [(conv, i) for conv in conversations for i, m in enumerate(conv.messages) if m.role == "assistant"]


def _generate(engine, tokenizer, prompts: list[list[int]],
              grammars: list[tuple[str, tuple[int, ...]] | None], max_tokens: int = 192):
    """Greedy answers: (text, whether it ended with the end token rather than at max_tokens).
    ``grammars``: each answer's grammar and the tokens it starts after (None: free)."""
    from model.runtime.batcher import generate
    from model.runtime.sampling import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, grammar=chosen[0] if chosen else None,
                             grammar_after=chosen[1] if chosen else ()) for chosen in grammars]
    outputs = generate(engine, prompts, params, (tokenizer.special.eos,), max_batch=16, tokenizer=tokenizer)
    # The end token is not returned: an answer that ended has fewer than max_tokens tokens.
    return [(tokenizer.decode(ids), len(ids) < max_tokens) for ids in outputs]


def _score_call(answer: tuple[str, bool], expected, functions: dict[str, dict]) -> dict[str, bool]:
    import jsonschema

    from model.tools import DSML, split_answer

    text, ended = answer
    _, calls = split_answer([text])
    parsed = []
    for call in calls:
        try:
            parsed.append((call.name, json.loads(call.arguments)))
        except json.JSONDecodeError:
            parsed.append((call.name, None))
    well_formed = bool(parsed) and all(isinstance(a, dict) for _, a in parsed) and DSML not in _
    right = well_formed and [name for name, _ in parsed] == [c.name for c in expected]
    valid = right and all(_valid(jsonschema, functions[name]["parameters"], arguments) for name, arguments in parsed)
    exact = valid and [a for _, a in parsed] == [json.loads(c.arguments) for c in expected]
    return {"well_formed": well_formed, "right_function": right, "valid_arguments": valid, "exact": exact,
            "cut_at_max_tokens": not ended}


def _valid(jsonschema, schema: dict, arguments: dict) -> bool:
    try:
        jsonschema.validate(arguments, schema)
        return True
    except jsonschema.ValidationError:
        return False


def _score_answer(answer: tuple[str, bool], conv, index: int) -> dict[str, bool]:
    from model.tools import split_answer

    content, calls = split_answer([answer[0]])
    expected = conv.messages[index].content
    results = []
    for message in reversed(conv.messages[:index]):
        if message.role != "tool":
            break
        results.append(message.content)
    has = all(r.strip() in content for r in results) if results else content.strip() == expected
    return {"no_call": not calls, "has_result": not calls and has, "exact": not calls and content.strip() == expected}


def _served_grammar(tools, choice: str, dsml: int | None) -> tuple[str, tuple[int, ...]] | None:
    """The grammar, and the tokens it starts after, that the server gives an answer
    under ``tool_choice`` ``choice`` (thinking off), or None for a free answer."""
    from cluster.serving.request import GenerationRequest
    from model.runtime.sampling import SamplingParams

    chosen = GenerationRequest("bench", SamplingParams(), False, False, tools=tuple(tools),
                               tool_choice=choice).grammar(dsml, None)
    return chosen[:2] if chosen is not None else None


def evaluate_tools(checkpoint_dir: Path, n: int = 100, seed: int = 1,
                   splits: tuple[str, ...] = ("held_out", "held_out_phrasing")) -> dict:
    """The scores (shares of turns) per split and turn kind, free and constrained."""
    import torch

    from model.training import tool_data
    from model.chat import ChatTemplate
    from model.tokenizer import Tokenizer
    from model.loader import load_checkpoint, load_hasher
    from model.runtime.engine import Engine

    checkpoint = load_checkpoint(checkpoint_dir)
    engine = Engine(checkpoint.backbone, load_hasher(checkpoint_dir, checkpoint.config))
    tokenizer = Tokenizer.from_dir(checkpoint_dir)
    template = ChatTemplate(tokenizer)
    report: dict = {}
    with torch.no_grad():
        for split in splits:
            turns = _turns(tool_data.conversations(n, split, seed))
            prompts = [template.render(conv.messages[:i], tools=conv.tools) for conv, i in turns]
            calling = [bool(conv.messages[i].tool_calls) for conv, i in turns]
            free = _generate(engine, tokenizer, prompts, [None] * len(prompts))
            call_idx = [k for k, c in enumerate(calling) if c]
            call_prompts = [prompts[k] for k in call_idx]
            constrained = {}
            for kind, choice in (("call_constrained", "required"), ("call_auto", "auto")):
                chosen = [_served_grammar(turns[k][0].tools, choice, tokenizer.special.dsml) for k in call_idx]
                if None not in chosen:  # (auto without the ｜DSML｜ token is free: no row)
                    constrained[kind] = dict(zip(call_idx, _generate(engine, tokenizer, call_prompts, chosen)))
            rows: dict[str, list[dict[str, bool]]] = {"call": [], **{kind: [] for kind in constrained}, "answer": []}
            for k, (conv, i) in enumerate(turns):
                functions = {f["name"]: f for f in conv.tools}
                if calling[k]:
                    expected = conv.messages[i].tool_calls
                    rows["call"].append(_score_call(free[k], expected, functions))
                    for kind, answers in constrained.items():
                        rows[kind].append(_score_call(answers[k], expected, functions))
                else:
                    rows["answer"].append(_score_answer(free[k], conv, i))
            report[split] = {kind: {"turns": len(scores),
                                    **{key: round(sum(s[key] for s in scores) / max(1, len(scores)), 3)
                                       for key in (scores[0] if scores else {})}}
                             for kind, scores in rows.items()}
            report[split]["examples"] = [{"prompt_tail": template.render_text(turns[k][0].messages[:turns[k][1]],
                                                                              tools=turns[k][0].tools)[-160:],
                                          "generated": free[k][0]} for k in range(min(4, len(turns)))]
    return report


def run(args: argparse.Namespace) -> int:
    from cluster import UserError
    from model.config import ConfigError
    from model.loader import CheckpointError

    try:
        report = evaluate_tools(args.checkpoint, args.n, args.seed)
    except (CheckpointError, ConfigError, OSError) as error:
        raise UserError(str(error)) from None
    print(f"v41 bench tools: {args.checkpoint}, {args.n} held-out conversations per split, greedy, teacher-forced")
    print(f"{'split':<18} {'turns':<17} {'n':>4} {'well-formed':>12} {'right fn':>9} {'valid args':>11} "
          f"{'exact':>6} {'cut':>5} {'no call':>8} {'has result':>11}")
    for split, kinds in report.items():
        for kind, row in kinds.items():
            if kind == "examples":
                continue
            cells = [f"{row[key]:.3f}" if key in row else "" for key in
                     ("well_formed", "right_function", "valid_arguments", "exact", "cut_at_max_tokens", "no_call",
                      "has_result")]
            print(f"{split:<18} {kind:<17} {row['turns']:>4} {cells[0]:>12} {cells[1]:>9} {cells[2]:>11} "
                  f"{cells[3]:>6} {cells[4]:>5} {cells[5]:>8} {cells[6]:>11}")
    if args.json:
        print(json.dumps(report))
    return 0
