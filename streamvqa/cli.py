"""The `streamvqa` command: ask about a video file, stream a file or a camera live with a
question every few seconds of video, watch a file or a camera for a yes/no condition, and look
at sessions. docs/client.md has examples.

Exit status: 0 when all went well, 1 when the gateway (or the way to it) failed, with its
message on stderr, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from tqdm import tqdm

from streamvqa.client import Answer, Client, Session, StreamvqaError, WatchFiredEvent
from streamvqa.client.wire import Call, gateway_api_key, gateway_url

DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)?")
# The ingest bar: the share of the video in the cache, then where it is and the time left, as the
# gateway reports them (`ingest_progress`, `ingest_eta_s`), redrawn at each look.
INGEST_BAR = "ingest: {percentage:3.0f}%|{bar}| {desc}"
DURATION_UNITS_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}

def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command in ("ask", "stream", "watch"):
        _check_media(parser, args)
    try:
        with Client(args.url, args.api_key) as client:
            return args.run(client, args)
    except (StreamvqaError, ImportError, OSError, ValueError) as err:  # the last three: the video cannot be read here
        print(f"streamvqa: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


# -- commands ------------------------------------------------------------------------------------


def ask(client: Client, args: argparse.Namespace) -> int:
    """Upload a video, wait for it to be in the cache, ask each question with its answer
    streamed to stdout."""
    with _new_session(client, args) as session:
        with _bar(unit="B", unit_scale=True, unit_divisor=1024, desc="upload") as bar:
            session.upload(args.video, progress=lambda sent, total: _advance(bar, sent, total))
        with _bar(total=100, bar_format=INGEST_BAR) as bar:
            record = session.wait_until_ingested(progress=lambda record: _show_ingest(bar, record))
        _print_warnings(record)
        for question in args.question:
            print(f"Q: {question}")
            print("A: ", end="", flush=True)
            stream = session.ask_stream(question, args.max_new_tokens, **_sampling(args))
            for piece in stream:
                print(piece, end="", flush=True)
            print()
            assert stream.answer is not None
            print(_evidence(stream.answer), flush=True)
    return 0


def stream(client: Client, args: argparse.Namespace) -> int:
    """Stream a file (at its own pace, or `--speed` times faster) or a camera as frames, asking
    the question every `--every` seconds of video on the socket; one line per answer."""
    with _new_session(client, args) as session:
        options = {
            "question": args.question,
            "every_s": args.every,
            "max_new_tokens": args.max_new_tokens,
            "sampling": _sampling(args),
            "on_answer": _print_answer_line,
        }
        if args.camera:
            result = session.stream_camera(args.camera, fps=args.fps, **options)
        else:
            result = session.stream_file(args.video, fps=args.fps, speed=args.speed, **options)
        print(
            f"streamed {result.frames_sent} frames: {result.frames_ingested} in the cache up to "
            f"{result.video_time_s:.1f} s, {result.frames_dropped} dropped",
            file=sys.stderr,
        )
        _print_warnings(session.info())
    return 0


def watch(client: Client, args: argparse.Namespace) -> int:
    """Watch a file (uploaded) or a camera (streamed) for a yes/no condition: one line per
    firing as it comes, and for a file, once it is all in the cache, the seconds it fired at."""
    with _new_session(client, args) as session:
        watched = session.watch(args.condition, every_s=args.every, threshold=args.threshold)
        every = f"every {watched.every_s:g} s, firing at p(yes) >= {watched.threshold:g}"
        print(f"watch {watched.id}: {watched.condition!r} {every}", file=sys.stderr)
        if args.camera:
            session.stream_camera(args.camera, fps=args.fps, on_event=_print_firing_event)
            return 0
        with _bar(unit="B", unit_scale=True, unit_divisor=1024, desc="upload") as bar:
            session.upload(args.video, progress=lambda sent, total: _advance(bar, sent, total))
        fired = []
        for firing in session.firings(watched.id):
            _print_firing(firing)
            fired.append(firing)
        _print_warnings(session.info())
        print("fired: " + (", ".join(f"{firing.time_s:.1f} s" for firing in fired) or "never"))
    return 0


def sessions(client: Client, _: argparse.Namespace) -> int:
    listing = client.send(Call("GET", "/sessions"))
    for record in listing["sessions"]:
        print(
            f"{record['id']}  {record['state']:<9}  {record['model']}  {record['policy']}  "
            f"frames={record['frames_ingested']}  t={record['video_time_s']:.1f}s"
        )
    unlisted = listing["counted"] - sum(record["state"] != "error" for record in listing["sessions"])
    if unlisted > 0:
        print(
            f"not listed: {unlisted} more session{'s' * (unlisted != 1)} of this address, counted toward its limit of "
            f"{listing['max_sessions']}; without API keys the gateway lists an address's sessions only where "
            "ADDRESS_OWNS_SESSIONS is set (end one with its token: delete ID --token T)", file=sys.stderr,
        )
    return 0


def info(client: Client, args: argparse.Namespace) -> int:
    print(json.dumps(client.session(args.id, args.token).info(), indent=2))
    return 0


def memory(client: Client, args: argparse.Namespace) -> int:
    print(json.dumps(client.session(args.id, args.token).memory(), indent=2))
    return 0


def delete(client: Client, args: argparse.Namespace) -> int:
    if args.token is None:
        client.end_session(args.id)  # as its owner
    else:
        client.session(args.id, args.token).delete()
    return 0


# -- helpers -------------------------------------------------------------------------------------


@contextlib.contextmanager
def _new_session(client: Client, args: argparse.Namespace) -> Iterator[Session]:
    """A session with the command's options, deleted after unless `--keep` (then its id and
    token go to stdout, for `info`, `memory` and `delete`)."""
    session = client.create_session(  # the options not given (None) keep the gateway's defaults
        fps=args.fps, policy=args.policy, budget_tokens=args.budget, model=args.model, recall=args.recall
    )
    print(f"session {session.id}", file=sys.stderr)
    if not args.keep:
        with session:
            yield session
        return
    try:
        yield session
    finally:
        print(f"session: {session.id}\ntoken: {session.token}")


def _sampling(args: argparse.Namespace) -> dict:
    """The sampling options of the command line; the client leaves out those not given (None)."""
    return {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed, "stop": args.stop}


def _bar(total: float | None = None, **options: object) -> tqdm:
    return tqdm(total=total, disable=None, leave=False, **options)  # disable=None: only on a terminal


def _show_ingest(bar: tqdm, record: dict) -> None:
    share = 1.0 if record["state"] == "ingested" else record.get("ingest_progress") or 0.0
    bar.n = round(100 * share, 1)
    bar.set_description_str(ingest_note(record), refresh=False)
    bar.refresh()


def ingest_note(record: dict) -> str:
    """Where an upload's ingest stands, for people: "1:05 of 4:00 · about 2:31 left"."""
    duration_s = record.get("media_duration_s")
    if record["state"] == "ingested":
        return f"{record['frames_ingested']} frames"
    if not record.get("upload_ended"):
        return "waiting for the upload"
    if not record["frames_ingested"]:
        return "starting"
    where = f"{_clock(record['video_time_s'])} of {_clock(duration_s)}" if duration_s else _clock(record["video_time_s"])
    eta_s = record.get("ingest_eta_s")
    return f"{where} · " + ("estimating the time left" if eta_s is None else f"about {_clock(max(1.0, eta_s))} left")


def _clock(seconds: float) -> str:
    """Whole seconds as m:ss, or h:mm:ss."""
    minutes, second = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{second:02d}" if hours else f"{minutes}:{second:02d}"


def _advance(bar: tqdm, done: float, total: float | None) -> None:
    if total is not None and bar.total != total:
        bar.total = total
    bar.update(done - bar.n)


def _print_warnings(record: dict) -> None:
    """The session's warnings (a file cut short, the context reached), to stderr."""
    for warning in record.get("warnings", []):
        print(f"streamvqa: warning: {warning['message']} ({warning['code']})", file=sys.stderr, flush=True)


def _print_answer_line(answer: Answer) -> None:
    print(f"[t={answer.video_time_s:.1f}s] {' '.join(answer.answer.split())}", flush=True)


def _print_firing(firing: WatchFiredEvent) -> None:
    evidence = ", ".join(f"{e.time_s:.1f}s ({e.weight:.2f})" for e in firing.evidence)
    print(f"{firing.time_s:.1f} s  p={firing.probability:.2f}  evidence: {evidence or 'none'}", flush=True)


def _print_firing_event(event: dict) -> None:
    if event["type"] == "watch_fired":
        _print_firing(WatchFiredEvent.model_validate(event))


def _evidence(answer: Answer) -> str:
    frames = ", ".join(f"{e.time_s:.1f}s ({e.weight:.2f})" for e in answer.evidence)
    recalled = f"; recalled from the host tier: {_seconds(answer.recalled_s)}" if answer.recalled_s else ""
    return f"evidence: {frames or 'none'}{recalled}"


def _seconds(seconds: list[int]) -> str:
    """Whole seconds as runs: [0, 1, 2, 5] -> "0-2 s, 5 s"."""
    runs: list[list[int]] = []
    for second in sorted(seconds):
        if runs and second == runs[-1][1] + 1:
            runs[-1][1] = second
        else:
            runs.append([second, second])
    return ", ".join(f"{a}-{b} s" if a != b else f"{a} s" for a, b in runs)


def _duration_s(text: str) -> float:
    match = DURATION.fullmatch(text.strip())
    if not match or float(match[1]) <= 0:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 10s, 1.5s, 2m)")
    return float(match[1]) * DURATION_UNITS_S[match[2] or "s"]


def _check_media(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.command in ("stream", "watch"):
        if args.command == "stream" and args.every and not args.question:
            parser.error("--every needs a --question")
        if args.camera and args.video:
            parser.error("give a VIDEO or --camera, not both")
        if args.camera:
            return
        if not args.video:
            parser.error("give a VIDEO file or --camera DEVICE")
    if not Path(args.video).is_file():
        parser.error(f"no such file: {args.video}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamvqa", description="Ask questions about a video, uploaded or live.")
    parser.add_argument("--url", default=gateway_url(None), help="the gateway (env STREAMVQA_URL)")
    parser.add_argument(
        "--api-key", default=gateway_api_key(None), help="the gateway's API key (env STREAMVQA_API_KEY)"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    options = argparse.ArgumentParser(add_help=False)  # the options of a new session
    options.add_argument("--fps", type=float, help="frames sampled per second of video (default: the gateway's, 1)")
    options.add_argument("--policy", help="KV cache policy: infmllm, snapkv, tova, knorm, h2o, sliding, full")
    options.add_argument("--budget", type=int, help="tokens each cache layer keeps (budget_tokens)")
    options.add_argument("--model", help="the model (default: the gateway's)")
    options.add_argument(
        "--recall", action=argparse.BooleanOptionalAction,
        help="keep what the cache evicts in a host tier; questions bring back what they need (the default for a policy that evicts)",
    )
    options.add_argument("--keep", action="store_true", help="keep the session and print its id and token")
    answers = argparse.ArgumentParser(add_help=False)  # how answers are made
    answers.add_argument("--max-new-tokens", type=int, default=64, help="the longest answer (default %(default)s)")
    answers.add_argument("--temperature", type=float, help="0 (greedy, the default) to 2: higher draws more freely")
    answers.add_argument("--top-p", type=float, help="draw among the likeliest tokens whose probabilities reach this")
    answers.add_argument("--top-k", type=int, help="draw among the k likeliest tokens")
    answers.add_argument("--seed", type=int, help="the same seed gives the same answer on the same video")
    answers.add_argument("--stop", action="append", help="end the answer before this text (repeat for more, up to 4)")

    command = _command(commands, "ask", ask, "upload a video, then ask about it", [options, answers])
    command.add_argument("video", metavar="VIDEO")
    command.add_argument("--question", "-q", action="append", required=True, help="a question (repeat for more)")

    summary = "stream a video file or a camera live, asking as it plays"
    command = _command(commands, "stream", stream, summary, [options, answers])
    command.add_argument("video", metavar="VIDEO", nargs="?")
    command.add_argument("--camera", metavar="DEVICE", help="a camera, not a file: /dev/video0 (Linux), 0 (macOS)")
    command.add_argument("--question", "-q", help="asked every --every seconds of video, and at the end")
    command.add_argument("--every", type=_duration_s, metavar="DURATION", help="e.g. 10s (without it: only at the end)")
    command.add_argument("--speed", type=float, default=1.0, help="times faster than real time (default %(default)s)")

    summary = "watch a video file or a camera for a yes/no condition, with a line each time it becomes true"
    command = _command(commands, "watch", watch, summary, [options])
    command.add_argument("video", metavar="VIDEO", nargs="?")
    command.add_argument("condition", metavar="CONDITION", help="e.g. 'a red circle is visible'")
    command.add_argument("--camera", metavar="DEVICE", help="a camera, not a file: /dev/video0 (Linux), 0 (macOS)")
    command.add_argument(
        "--every", type=_duration_s, metavar="DURATION",
        help="video between two checks, at least the frame interval (default: the gateway's, 2s)",
    )
    command.add_argument(
        "--threshold", type=float, metavar="P", help="p(yes) at or above which it fires, in (0, 1] (default: the gateway's, 0.5)"
    )

    _command(commands, "sessions", sessions, "list your sessions (of your API key; without keys, of your address where "
             "the gateway sets ADDRESS_OWNS_SESSIONS)")
    for name, run, summary in (
        ("info", info, "show a session"),
        ("memory", memory, "show a session's cache: policy, tokens held, evictions, spans of video"),
        ("delete", delete, "delete a session: with its token, or one of yours without it"),
    ):
        command = _command(commands, name, run, summary)
        command.add_argument("id", metavar="ID")
        if run is delete:
            command.add_argument("--token", help="the session's token (not needed for one of your sessions: with your "
                                 "API key, or without keys where the gateway sets ADDRESS_OWNS_SESSIONS)")
        else:
            command.add_argument("--token", required=True, help="the session's token")
    return parser


def _command(
    commands: argparse._SubParsersAction,
    name: str,
    run: Callable[[Client, argparse.Namespace], int],
    summary: str,
    parents: list[argparse.ArgumentParser] | None = None,
) -> argparse.ArgumentParser:
    command = commands.add_parser(name, help=summary, description=summary, parents=parents or [])
    command.set_defaults(run=run)
    return command


if __name__ == "__main__":
    sys.exit(main())
