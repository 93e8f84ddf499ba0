"""Row formats: which one a source holds, each row's problem, and rows normalised to dialogues or conversations.

Formats (data.format; `auto` names one from the first rows' keys, dialogue when none match):
- dialogue: a dialogue and a summary column, put in a prompt around data.instruction (data.py);
- prompt_completion: `prompt` and `completion` text;
- messages: `messages`, a list of {role, content}, roles system (first only), user and assistant;
- alpaca: `instruction`, an optional `input` and `output` (and an optional `system`);
- sharegpt: `conversations`, a list of {from, value}, from system, human or gpt.
Every format but dialogue becomes a conversation, {"id", "messages"} of system, user and assistant
turns (chat.py renders them); a dialogue row stays {"id", "dialogue", "summary"}. Rows for
generation (`answer=False`: predict's input) need no assistant turn.
"""
from __future__ import annotations

import json

FORMATS = ("dialogue", "prompt_completion", "messages", "alpaca", "sharegpt")
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
TOOLS = ("tool", "function", "ipython", "observation", "function_call", "tool_call")
COLUMNS = {"dialogue": ("dialogue_column", "summary_column"), "prompt_completion": ("prompt_column", "completion_column")}
AUTO_ROWS = 8  # data.format=auto reads the keys of this many first rows
KINDS = {bool: "true/false", int: "a number", float: "a number", list: "a list", dict: "an object", type(None): "null"}


def keys_of(fmt: str, d) -> tuple[str, ...]:
    """The keys a row of `fmt` must hold (`d`: the DataConfig, for the dialogue columns)."""
    return {"dialogue": (d.dialogue_column, d.summary_column), "prompt_completion": (d.prompt_column, d.completion_column),
            "messages": ("messages",), "alpaca": ("instruction", "output"), "sharegpt": ("conversations",)}[fmt]


def asked_keys(fmt: str, d) -> tuple[str, ...]:
    """The keys a row of `fmt` must hold to be prompted (predict's input: no answer needed)."""
    return {"dialogue": (d.dialogue_column,), "prompt_completion": (d.prompt_column,), "messages": ("messages",),
            "alpaca": ("instruction",), "sharegpt": ("conversations",)}[fmt]


def sample(fmt: str, d, answer: bool = False) -> str:
    """One row of `fmt` as a JSON line, e.g. what predict takes (`answer`: with what is trained, as eval's data.val)."""
    row = {"dialogue": {d.dialogue_column: "A: hi\nB: hello", **({d.summary_column: "They greet."} if answer else {})},
           "prompt_completion": {d.prompt_column: "Capital of France?", **({d.completion_column: "Paris."} if answer else {})},
           "messages": {"messages": [{"role": "user", "content": "Hi"}] + [{"role": "assistant", "content": "Hello!"}] * answer},
           "alpaca": {"instruction": "Summarize.", "input": "A: hi\nB: hey", **({"output": "They greet."} if answer else {})},
           "sharegpt": {"conversations": [{"from": "human", "value": "Hi"}] + [{"from": "gpt", "value": "Hello!"}] * answer}}[fmt]
    return json.dumps(row)


def asked_format(row, d, among: tuple[str, ...] = FORMATS) -> str | None:
    """The first format of `among` whose prompt keys (asked_keys) the row holds, or None."""
    return next((f for f in among if isinstance(row, dict) and set(asked_keys(f, d)) <= row.keys()), None)


def shape_problem(row: dict, d, taken: tuple[str, ...], answer: bool = False) -> str:
    """For a row of none of the formats a run trained on (`taken`): what it is, the keys it lacks, and the rows the run takes."""
    other, has = asked_format(row, d), ", ".join(sorted(map(str, row))) or "nothing"
    need = "; ".join(f"{f} rows need {' and '.join(map(repr, keys_of(f, d) if answer else asked_keys(f, d)))}" for f in taken)
    return (f"{f'is a {other} row' if other else 'is a row of no format the run takes'} (it has: {has}), but the run "
            f"trained on {' and '.join(taken)} rows ({need}): give it rows of that shape, e.g. {sample(taken[0], d, answer)}")


def detect(rows: list, d, fmt: str | None = None) -> str:
    """The format of a source's rows: `fmt` (or data.format) unless auto; else the first format whose
    keys every one of the first rows holds (dialogue first, so what ran before runs as before), dialogue when none."""
    fmt = fmt or d.format
    if fmt != "auto":
        return fmt
    first = rows[:AUTO_ROWS]
    if first and all(isinstance(r, dict) for r in first):
        for name in FORMATS:
            if all(set(keys_of(name, d)) <= r.keys() for r in first):
                return name
    return "dialogue"


def of_row(row, d) -> str | None:
    """The first format whose keys the row holds (dialogue first, as `detect`), or None."""
    return next((f for f in FORMATS if isinstance(row, dict) and set(keys_of(f, d)) <= row.keys()), None)


def mixed(rows: list, d) -> str | None:
    """With data.format auto: what is wrong when the first rows are of different formats (one format per source)."""
    if d.format != "auto":
        return None
    found = [of_row(r, d) for r in rows[:AUTO_ROWS]]
    kinds = list(dict.fromkeys(f for f in found if f))
    if len(kinds) < 2:
        return None
    second = next(i for i, f in enumerate(found) if f == kinds[1])
    return (f"its first rows are of two formats: row {found.index(kinds[0])} is a {kinds[0]} row, row {second} a "
            f"{kinds[1]} row (one format per source: split the file by format and give data.train a list of them)")


def other_format(row, fmt: str, d) -> str | None:
    """For a row that `fmt` cannot use but another format can: what to say instead of its missing keys."""
    other = of_row(row, d) if d.format == "auto" else None
    if other is None or other == fmt:
        return None
    return (f"is a {other} row, but the source's first rows are {fmt} rows (one format per source: split the file "
            "by format and give data.train a list of them)")


def lacking(row, fmt: str, d) -> str | None:
    """For an object row without every key of `fmt`: the format its keys name (data.format auto: the one whose
    keys it holds most of), the keys it lacks, and the config key that fixes it (COLUMNS), as the rest of a line
    after "row N of SOURCE"; None for a row that holds them all, or is no object."""
    if not isinstance(row, dict) or set(keys_of(fmt, d)) <= row.keys():
        return None
    has = ", ".join(sorted(map(str, row))) or "nothing"
    auto = d.format == "auto"
    guess = max(FORMATS, key=lambda f: (len(set(keys_of(f, d)) & row.keys()), f == fmt)) if auto else fmt
    need = keys_of(guess, d)
    if auto and not set(need) & row.keys():
        keys = ", or ".join(f"data.{a} and data.{b}" for a, b in COLUMNS.values())
        return f" holds the keys of no format (it has: {has}): name its columns with {keys}; or set data.format to its format"
    missing = [k for k in need if k not in row]
    spare = [k for k in row if k not in need and k != "id" and isinstance(row[k], str)]
    if full := of_row(row, d):
        fix = f"its keys are a {full} row's: set data.format={full}, or auto"
    elif guess in COLUMNS:
        names = [f"data.{COLUMNS[guess][need.index(k)]}" for k in missing]
        fix = (f"set {names[0]}={spare[0]}" if len(names) == len(spare) == 1 else
               f"set {' and '.join(names)} to the column{'s' * (len(names) > 1)} holding {'them' if len(names) > 1 else 'it'}"
               + (f": {', '.join(spare)}" if spare else ""))
    else:
        fix = f"rename {'their columns' if len(missing) > 1 else 'its column'} to {' and '.join(map(repr, missing))}"
    what = f" is nearest to a {guess} row, but" if auto else f" ({fmt}):"
    return f"{what} lacks {' and '.join(map(repr, missing))} (it has: {has}): {fix}"


def text_problem(text: str) -> str | None:
    """What keeps a string from being tokenized: a lone surrogate (valid JSON, not valid Unicode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"holds text that is not valid Unicode (a lone surrogate at character {e.start}; remove or replace it)"
    return None


def kind(value) -> str:
    """What a JSON value is, in words, shown briefly."""
    shown = repr(value)
    return f"{KINDS.get(type(value), type(value).__name__)} ({shown if len(shown) <= 40 else shown[:37] + '...'})"


def turns_of(row: dict, fmt: str, d) -> tuple[list | None, str | None]:
    """(the row's turns as [role, content, original] triples, None) or (None, what is wrong)."""
    if fmt == "prompt_completion":
        return [["user", row.get(d.prompt_column), d.prompt_column], ["assistant", row.get(d.completion_column),
                                                                         d.completion_column]], None
    if fmt == "alpaca":
        instruction, extra = row.get("instruction"), row.get("input") or ""
        if not isinstance(extra, str):
            return None, f"'input' holds {kind(extra)}, not text (write it as a string)"
        user = f"{instruction}\n\n{extra}" if isinstance(instruction, str) and instruction and extra else instruction
        system = [["system", row["system"], "system"]] if row.get("system") else []
        return system + [["user", user, "instruction"], ["assistant", row.get("output"), "output"]], None
    key, role_key, text_key = ("messages", "role", "content") if fmt == "messages" else ("conversations", "from", "value")
    if key not in row:
        return None, f"has no {key!r} (it has: {', '.join(sorted(map(str, row))) or 'nothing'}; set data.format to its format)"
    turns = row[key]
    if not isinstance(turns, list) or not turns:
        return None, f"{key!r} holds {kind(turns)}, not a list of turns"
    out = []
    for n, m in enumerate(turns):
        if not isinstance(m, dict):
            return None, f"turn {n} is {kind(m)}, not an object of {role_key} and {text_key}"
        role = m.get(role_key, m.get("role"))
        text = m.get(text_key, m.get("content"))
        if role is None:
            return None, f"turn {n} has no {role_key!r} (give every turn one: {', '.join(ROLES if fmt == 'messages' else ('system', 'human', 'gpt'))})"
        if role in TOOLS or (isinstance(m.get("tool_calls"), list) and m["tool_calls"]):
            return None, f"turn {n} is a tool turn ({role!r}): tool calls are not trained yet (remove those turns)"
        mapped = role if fmt == "messages" and role in ROLES else SHAREGPT_ROLES.get(role) if fmt == "sharegpt" else None
        if mapped is None:
            known = ", ".join(ROLES if fmt == "messages" else SHAREGPT_ROLES)
            return None, f"turn {n} has the unknown {role_key} {role!r} (use {known})"
        out.append([mapped, text, f"turn {n}"])
    return out, None


def problem(row, fmt: str, d, answer: bool = True) -> str | None:
    """What is wrong with one row of a chat format, or None (data.column_problem checks dialogue rows).
    `answer`: the row must hold what is trained (an assistant turn, a completion, an output); predict's need not."""
    if not isinstance(row, dict):
        return f"is {KINDS.get(type(row), type(row).__name__)}, not an object of fields"
    turns, wrong = turns_of(row, fmt, d)
    if wrong:
        return wrong
    if not answer:
        turns = [t for t in turns if t[0] != "assistant" or t[1] is not None]
    for role, text, where in turns:
        if not isinstance(text, str):
            missing = text is None and where in (*keys_of("prompt_completion", d), "instruction", "output")
            return (f"has no text {where!r}" if missing else f"{where} holds {kind(text)}, not text") + " (write it as a string)"
        if not text.strip():
            return f"{where} is empty (give every turn its text, or remove the turn)"
        if wrong := text_problem(text):
            return f"{where} {wrong}"
    roles = [t[0] for t in turns]
    if "system" in roles[1:]:
        return f"{turns[roles.index('system', 1)][2]} is a system turn after the first (only the first turn may be one)"
    spoken = [r for r in roles if r != "system"]
    if not spoken or spoken[0] != "user":
        return "starts with an assistant turn (the first turn after any system one must be the user's)" if spoken \
            else "has no user turn"
    if answer and "assistant" not in roles:
        return "has no assistant turn (nothing to train on or score: end it with the assistant's reply)"
    return None


def normalise(row: dict, i: int, fmt: str, d) -> dict:
    """A checked row (`problem` found nothing) as {"id", "dialogue", "summary"} or {"id", "messages"}, the
    messages begun by data.system_prompt where set and the row has no system turn of its own."""
    ident = str(row.get("id", i))
    if fmt == "dialogue":
        return {"id": ident, "dialogue": row[d.dialogue_column], "summary": row.get(d.summary_column, "")}
    turns, _ = turns_of(row, fmt, d)
    messages = [{"role": r, "content": t} for r, t, _ in turns if isinstance(t, str)]
    if d.system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": d.system_prompt})
    return {"id": ident, "messages": messages}


def context_and_answer(messages: list[dict]) -> tuple[list[dict], str | None]:
    """(the turns before the last assistant turn, that turn's text): a reference and what leads to it;
    without an assistant turn, (the turns up to the last user turn, None): what predict prompts with."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        end = max(i for i, m in enumerate(messages) if m["role"] == "user")
        return messages[:end + 1], None
    return messages[:last], messages[last]["content"]
