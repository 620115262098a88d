"""The `streamvqa` command as a user runs it: a real process against a real gateway and worker."""

import asyncio
import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamvqa.client import AsyncClient, Client, StreamvqaError
from streamvqa.redis_server import free_port
from tests.media import cut_before_frame, faststart_mp4
from tests.support import Stack, delete_prefix, sample_video

BIKES = sample_video("bikes.mp4")  # 10 s; at fps 1 its frames are at 0, 1, ... 9 s
CARPHONE = sample_video("carphone_pristine.mp4")  # 4 frames at fps 1
ANSWER_LINE = re.compile(r"\[t=(\d+\.\d)s\] .*")
API_KEY = "key-0123456789abcdef"


def streamvqa(*args: str, url: str | None = None, api_key: str | None = None) -> subprocess.CompletedProcess:
    """The command's run, with `url` and `api_key` given by the environment (none when None)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("STREAMVQA_")}
    if url:
        env["STREAMVQA_URL"] = url
    if api_key:
        env["STREAMVQA_API_KEY"] = api_key
    command = [sys.executable, "-m", "streamvqa.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=180)


def streamvqa_in_a_terminal(*args: str, url: str) -> str:
    """What the command writes to a 120-column terminal (a pseudo-terminal: its bars are drawn)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("STREAMVQA_")}
    master, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    command = [sys.executable, "-m", "streamvqa.cli", "--url", url, *args]
    process = subprocess.Popen(command, stdin=terminal, stdout=terminal, stderr=terminal, env=env)
    os.close(terminal)
    output = bytearray()
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the command ended and closed the terminal
            break
        if not chunk:
            break
        output += chunk
    os.close(master)
    assert process.wait(timeout=180) == 0, output.decode(errors="replace")
    return output.decode(errors="replace")


def session_is_gone(url: str, session_id: str) -> bool:
    with Client(url) as client:
        try:
            client.session(session_id, "not-its-token").info()  # 403 while it exists
        except StreamvqaError as err:
            return err.status == 404
    return False


def test_ask_uploads_waits_and_answers_each_question_then_deletes_the_session(stack):
    questions = ["-q", "What is happening?", "-q", "Who rides?"]
    run = streamvqa("ask", str(BIKES), *questions, "--fps", "1", "--max-new-tokens", "8", url=stack.url)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert [line for line in lines if line.startswith("Q: ")] == ["Q: What is happening?", "Q: Who rides?"]
    assert len([line for line in lines if line.startswith("A: ")]) == 2
    evidence = [line for line in lines if line.startswith("evidence: ")]
    assert len(evidence) == 2
    times = {float(t) for line in evidence for t in re.findall(r"(\d+\.\d)s \(", line)}
    assert times and times <= {float(t) for t in range(10)}
    session_id = re.search(r"^session ([0-9a-f]{32})$", run.stderr, re.M)[1]
    assert session_is_gone(stack.url, session_id)


def test_ask_shows_a_long_videos_ingest_step_by_step_with_the_time_left(stack, tmp_path):
    video = tmp_path / "minute.mp4"
    faststart_mp4(60, video)  # at 4 frames/s: 240 frames, 30 steps of 8
    output = streamvqa_in_a_terminal("ask", str(video), "-q", "What?", "--fps", "4", "--max-new-tokens", "4", url=stack.url)
    drawn = [line.strip() for line in re.split(r"[\r\n]", output) if line.startswith("ingest:")]
    shares = [int(re.match(r"ingest:\s*(\d+)%", line)[1]) for line in drawn]
    assert shares == sorted(shares) and shares[-1] == 100, shares  # it never goes back
    assert len({share for share in shares if 0 < share < 100}) >= 3, shares  # and moves in steps, not in one jump
    assert any(re.search(r"\| 0:\d\d of 1:00 · about 0:\d\d left$", line) for line in drawn), drawn
    assert re.search(r"ingest: 100%\|█+\| 240 frames$", drawn[-1]), drawn[-1]
    assert "Q: What?" in output


def test_with_recall_an_answer_says_which_seconds_it_brought_back(stack):
    options = ["--fps", "4", "--policy", "sliding", "--budget", "256", "--recall", "--max-new-tokens", "2"]
    run = streamvqa("ask", str(BIKES), "-q", "What came first?", *options, url=stack.url)
    assert run.returncode == 0, run.stderr
    evidence = next(line for line in run.stdout.splitlines() if line.startswith("evidence: "))
    recalled = re.search(r"; recalled from the host tier: (.+)$", evidence)[1]  # e.g. "0-6 s"
    assert re.fullmatch(r"\d+(-\d+)? s(, \d+(-\d+)? s)*", recalled)
    assert int(re.match(r"\d+", recalled)[0]) < 7  # sliding keeps the last ~3 s on the device


def test_a_kept_session_can_be_shown_measured_and_deleted_by_its_token(stack):
    run = streamvqa("--url", stack.url, "ask", str(CARPHONE), "-q", "hi", "--max-new-tokens", "2", "--keep")
    assert run.returncode == 0, run.stderr
    session_id = re.search(r"^session: ([0-9a-f]{32})$", run.stdout, re.M)[1]
    token = re.search(r"^token: (\S+)$", run.stdout, re.M)[1]
    by_id = ["--url", stack.url]

    info = streamvqa(*by_id, "info", session_id, "--token", token)
    assert info.returncode == 0, info.stderr
    assert (json.loads(info.stdout)["state"], json.loads(info.stdout)["frames_ingested"]) == ("ingested", 4)
    memory = streamvqa(*by_id, "memory", session_id, "--token", token)
    assert memory.returncode == 0, memory.stderr
    assert json.loads(memory.stdout)["policy"] == "infmllm"
    listed = streamvqa(*by_id, "sessions")  # without API keys an address lists no session without its token
    assert listed.returncode == 0, listed.stderr
    assert session_id not in listed.stdout and listed.stderr.startswith("not listed: "), listed.stderr

    assert streamvqa(*by_id, "delete", session_id, "--token", token).returncode == 0
    gone = streamvqa(*by_id, "info", session_id, "--token", token)
    assert gone.returncode == 1
    assert "no session" in gone.stderr and "(session_not_found)" in gone.stderr


def test_stream_plays_a_file_live_and_answers_every_few_seconds_of_video(stack):
    options = ["--every", "5s", "-q", "What changed?", "--speed", "4", "--fps", "1", "--max-new-tokens", "4"]
    run = streamvqa("stream", str(BIKES), *options, url=stack.url)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines and all(ANSWER_LINE.fullmatch(line) for line in lines), lines
    times = [float(ANSWER_LINE.fullmatch(line)[1]) for line in lines]
    assert times[0] >= 5.0 and times[-1] == 9.0  # the last answer saw it all
    assert all(earlier < later for earlier, later in zip(times, times[1:]))
    assert "streamed 10 frames: 10 in the cache up to 9.0 s, 0 dropped" in run.stderr


def test_watch_uploads_a_file_prints_each_firing_as_it_comes_then_the_seconds_it_fired_at(stack):
    """The tiny random model's p(yes) is arbitrary but never near 0 nor 1: at a threshold of 1e-6
    the condition always holds (it fires once, at its first check), at 1 it never does."""
    watching = ["--fps", "1", "--every", "2s"]
    run = streamvqa("watch", str(BIKES), "a bike is visible", *watching, "--threshold", "1e-6", url=stack.url)
    assert run.returncode == 0, run.stderr
    firing, summary = run.stdout.splitlines()
    assert re.fullmatch(r"2\.0 s  p=0\.\d\d  evidence: [0-2]\.0s \(\d\.\d\d\)(, [0-2]\.0s \(\d\.\d\d\))*", firing), firing  # checks at 2, 4, 6 and 8 s of its 0..9 s
    assert summary == "fired: 2.0 s"
    watch_line = re.search(r"^watch [0-9a-f]{32}: 'a bike is visible' every 2 s, firing at p\(yes\) >= 1e-06$", run.stderr, re.M)
    assert watch_line, run.stderr
    assert session_is_gone(stack.url, re.search(r"^session ([0-9a-f]{32})$", run.stderr, re.M)[1])

    never = streamvqa("watch", str(CARPHONE), "a bike is visible", "--threshold", "1", url=stack.url)
    assert (never.returncode, never.stdout) == (0, "fired: never\n"), never.stderr


def test_ask_about_a_file_cut_short_warns_on_stderr_and_answers_about_what_it_has(stack, tmp_path):
    whole = tmp_path / "whole.mp4"
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(cut_before_frame(faststart_mp4(10.0, whole), 50))  # 5 of its 10 s

    run = streamvqa("ask", str(cut), "-q", "hi", "--max-new-tokens", "2", url=stack.url)
    assert run.returncode == 0, run.stderr
    warnings = [line for line in run.stderr.splitlines() if line.startswith("streamvqa: warning: ")]
    assert warnings == [
        "streamvqa: warning: the file ends after 5.0 s of the 10.0 s it states (it was cut short, as by a download "
        "or copy that stopped part-way): 5 frames were ingested, up to 4.0 s; upload the whole file to a new session "
        "for the rest (truncated_media)"
    ]
    evidence = next(line for line in run.stdout.splitlines() if line.startswith("evidence: "))
    assert {float(t) for t in re.findall(r"(\d+\.\d)s \(", evidence)} <= {0.0, 1.0, 2.0, 3.0, 4.0}

    run = streamvqa("ask", str(whole), "-q", "hi", "--max-new-tokens", "2", url=stack.url)
    assert run.returncode == 0, run.stderr
    assert "warning" not in run.stderr


def test_gateway_errors_exit_1_with_the_message(stack, tmp_path):
    nowhere = streamvqa("ask", str(BIKES), "-q", "hi", url=f"http://127.0.0.1:{free_port()}")
    assert nowhere.returncode == 1
    assert "cannot reach the gateway at http://127.0.0.1:" in nowhere.stderr

    unknown = streamvqa("--url", stack.url, "info", "0" * 32, "--token", "x")
    assert unknown.returncode == 1
    assert unknown.stderr.startswith("streamvqa: error: no session 000")

    too_hot = streamvqa("ask", str(CARPHONE), "-q", "hi", "--temperature", "3", url=stack.url)
    assert too_hot.returncode == 1
    assert "body.temperature: Input should be less than or equal to 2" in too_hot.stderr

    not_a_video = tmp_path / "notes.mp4"
    not_a_video.write_text("not a video at all\n" * 100)
    failed = streamvqa("ask", str(not_a_video), "-q", "hi", url=stack.url)
    assert failed.returncode == 1
    assert "the session failed" in failed.stderr and "(session_error)" in failed.stderr


def test_usage_errors_exit_2():
    entry_point = Path(sys.executable).with_name("streamvqa")  # the installed command
    assert subprocess.run([entry_point, "--help"], capture_output=True).returncode == 0
    for args, message in [
        ([], "required: COMMAND"),
        (["ask", str(BIKES)], "required: --question"),
        (["ask", "no-such-video.mp4", "-q", "hi"], "no such file: no-such-video.mp4"),
        (["stream", "-q", "hi"], "give a VIDEO file or --camera DEVICE"),
        (["stream", str(BIKES), "--every", "5s"], "--every needs a --question"),
        (["stream", str(BIKES), "--every", "soon", "-q", "hi"], "not a duration: 'soon'"),
        (["watch", "a bike is visible"], "give a VIDEO file or --camera DEVICE"),
        (["watch", str(BIKES), "a bike", "--camera", "0"], "give a VIDEO or --camera, not both"),
        (["watch", str(BIKES), "a bike", "--every", "soon"], "not a duration: 'soon'"),
        (["info", "abc"], "required: --token"),
    ]:
        run = streamvqa(*args)
        assert (run.returncode, message in run.stderr) == (2, True), (args, run.stderr)


@pytest.fixture(scope="module")
def keyed_gateway(redis_url, tmp_path_factory) -> Iterator[str]:
    """A gateway that wants an API key, and no worker: a session it lets through gets no_worker."""
    stack = Stack(redis_url, f"svqa-test-{uuid.uuid4().hex[:12]}:", tmp_path_factory.mktemp("keyed"), API_KEYS=API_KEY)
    stack.start("gateway", "app")
    try:
        stack.wait_until_serving(workers=0)
        yield stack.url
    finally:
        stack.stop()
        delete_prefix(redis_url, stack.prefix)


def test_the_api_key_comes_from_the_option_or_the_environment(keyed_gateway):
    missing = streamvqa("sessions", url=keyed_gateway)
    assert (missing.returncode, "(api_key_required)" in missing.stderr) == (1, True), missing.stderr
    wrong = streamvqa("--api-key", "guessed", "sessions", url=keyed_gateway)
    assert (wrong.returncode, "(api_key_invalid)" in wrong.stderr) == (1, True), wrong.stderr
    listed = streamvqa("sessions", url=keyed_gateway, api_key=API_KEY)
    assert (listed.returncode, listed.stdout) == (0, "")
    let_in = streamvqa("--api-key", API_KEY, "ask", str(CARPHONE), "-q", "hi", url=keyed_gateway)
    assert (let_in.returncode, "(no_worker)" in let_in.stderr) == (1, True), let_in.stderr


def test_the_python_client_finds_the_gateway_and_its_key_in_the_environment_as_the_command_does(keyed_gateway, monkeypatch):
    monkeypatch.delenv("STREAMVQA_API_KEY", raising=False)
    monkeypatch.setenv("STREAMVQA_URL", keyed_gateway + "/")
    with Client() as client, pytest.raises(StreamvqaError) as refused:
        client.sessions()
    assert (client.base_url, refused.value.code) == (keyed_gateway, "api_key_required")  # reached, and wants a key

    monkeypatch.setenv("STREAMVQA_API_KEY", API_KEY)
    with Client() as client:
        assert client.sessions() == []
    with Client(api_key="guessed") as client, pytest.raises(StreamvqaError) as refused:  # an argument wins
        client.sessions()
    assert refused.value.code == "api_key_invalid"

    async def listed_async() -> list:
        async with AsyncClient() as client:
            return await client.sessions()

    assert asyncio.run(listed_async()) == []
