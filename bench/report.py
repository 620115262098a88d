"""Markdown tables from benchmark JSON lines: `python -m bench.report FIELD,FIELD,... < lines.jsonl`.

Lines that lack any of the fields are skipped, so one call per table picks its rows out of a
mixed log (e.g. `policy,budget,tokens,ppl,ppl_context` or `policy,budget,filler_tokens,recall`).
"""

import json
import sys


def table(fields: list[str], lines: list[dict]) -> str:
    rows = [line for line in lines if all(f in line for f in fields)]
    out = ["| " + " | ".join(fields) + " |", "|" + "---|" * len(fields)]
    out += ["| " + " | ".join(str(row[f]) for f in fields) + " |" for row in rows]
    return "\n".join(out)


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    lines = [json.loads(text) for text in sys.stdin if text.strip().startswith("{")]
    print(table(sys.argv[1].split(","), lines))


if __name__ == "__main__":
    main()
