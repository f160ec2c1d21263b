"""`quipu run` driven as a user drives it: the real command in a subprocess, the bundled model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.model

GREEDY = ["--temperature", "0"]


@pytest.mark.quick  # (the quick set's one test on a real model)
def test_greedy_raw_completion_knows_paris(quipu):
    r = quipu("run", "--raw", *GREEDY, "-n", "8", "The capital of France is")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout.decode()


def test_nothing_but_generated_text_reaches_stdout_and_stderr_is_quiet(quipu):
    r = quipu("run", *GREEDY, "-n", "12", "Say hello.")
    assert r.returncode == 0
    assert r.stdout.strip()
    assert r.stderr == b"", r.stderr.decode()


def test_same_seed_same_text(quipu):
    args = ("run", "--seed", "1234", "--temperature", "0.9", "-n", "24", "Tell me a story.")
    a, b = quipu(*args), quipu(*args)
    assert a.returncode == b.returncode == 0
    assert a.stdout == b.stdout and a.stdout.strip()


def test_json_has_exactly_the_contract_fields(quipu):
    r = quipu("run", "--json", "--seed", "9", "-n", "10", "Hi")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"text", "reasoning", "finish_reason", "model", "seed", "session", "usage", "timings",
                        "placement"}
    assert out["reasoning"] is None  # SmolLM2 does not think aloud
    # Where the model ran: the backend, its devices and the layers on them, of how many, what each took.
    assert set(out["placement"]) == {"backend", "devices", "gpu_layers", "layers", "memory", "summary"}
    assert set(out["usage"]) == {"prompt_tokens", "completion_tokens", "cached_tokens"}
    assert set(out["timings"]) == {
        "load_s", "restore_s", "prefill_s", "decode_s", "ttft_s", "prefill_tok_s", "decode_tok_s"
    }
    assert out["seed"] == 9 and out["session"] is None
    assert out["finish_reason"] in ("stop", "length")
    assert out["usage"]["completion_tokens"] <= 10 and out["usage"]["prompt_tokens"] > 0
    assert out["model"] == "SmolLM2-135M-Instruct"


def test_random_seed_is_reported_and_reproduces(quipu):
    first = json.loads(quipu("run", "--json", "-n", "16", "Name a color.").stdout)
    again = json.loads(quipu("run", "--json", "-n", "16", "--seed", first["seed"], "Name a color.").stdout)
    assert again["text"] == first["text"]


def test_piped_stdin_follows_the_prompt(quipu):
    alone = json.loads(quipu("run", "--json", *GREEDY, "-n", "4", "Summarize:").stdout)
    piped = quipu("run", "--json", *GREEDY, "-n", "4", "Summarize:", input="The sky is blue because of Rayleigh scattering.\n")
    assert piped.returncode == 0
    assert json.loads(piped.stdout)["usage"]["prompt_tokens"] > alone["usage"]["prompt_tokens"] + 5
    only_stdin = quipu("run", *GREEDY, "-n", "4", input="Why is the sky blue?")
    assert only_stdin.returncode == 0 and only_stdin.stdout.strip()


def test_stop_string_never_printed(quipu):
    full = quipu("run", *GREEDY, "-n", "40", "Count from 1 to 20, separated by commas.").stdout.decode()
    assert "5" in full, full
    cut = quipu("run", *GREEDY, "-n", "40", "--stop", "5", "--json", "Count from 1 to 20, separated by commas.")
    out = json.loads(cut.stdout)
    assert out["finish_reason"] == "stop_sequence"
    assert "5" not in out["text"]
    assert full.startswith(out["text"])


def test_stats_line_on_stderr(quipu):
    r = quipu("run", "--stats", "-n", "5", "Hi")
    assert r.returncode == 0
    assert "tok/s" in r.stderr.decode() and "tok/s" not in r.stdout.decode()


@pytest.mark.parametrize(
    "args, stdin, code, message",
    [
        (["run"], None, 2, "no prompt"),
        (["run", "--top-p", "1.5", "hi"], None, 2, "top-p"),
        (["run", "--temperature", "-1", "hi"], None, 2, "temperature"),
        (["run", "--max-tokens", "0", "hi"], None, 2, "max-tokens"),
        (["run", "--ctx", "-5", "hi"], None, 2, "ctx"),
        (["run", "--top-k", "lots", "hi"], None, 2, "top-k"),
        (["run", "-m", "/no/such/model.gguf", "hi"], None, 2, "model"),
        (["run", "--kv-type", "q3", "hi"], None, 2, "kv-type"),
        (["run", "hi"], b"\x00\x01\x02binary\xff", 2, "binary"),
        (["run", "--ctx", "64"], b"the sky is blue " * 200, 2, "context"),
    ],
)
def test_bad_input_is_one_clear_line_and_the_documented_exit_code(quipu, args, stdin, code, message):
    r = quipu(*args, input=stdin)
    err = r.stderr.decode()
    assert r.returncode == code, err
    assert message in err.lower()
    assert "Traceback" not in err


def test_a_file_that_is_not_a_model_fails_to_load_with_exit_1(quipu, tmp_path):
    bogus = tmp_path / "notes.gguf"
    bogus.write_text("just some notes")
    r = quipu("run", "-m", bogus, "hi")
    assert r.returncode == 1
    assert "not a GGUF" in r.stderr.decode() and "Traceback" not in r.stderr.decode()


def test_invalid_utf8_stdin_is_replaced_with_a_warning(quipu):
    r = quipu("run", "-n", "3", input=b"caf\xe9 au lait")
    assert r.returncode == 0
    assert "UTF-8" in r.stderr.decode()


def test_prompt_too_long_names_the_numbers(quipu):
    r = quipu("run", "--ctx", "64", input=b"the sky is blue " * 200)
    err = r.stderr.decode()
    assert "64" in err and "tokens" in err


def test_debug_shows_the_traceback(quipu):
    r = quipu("run", "--top-p", "2", "hi", env={"QUIPU_DEBUG": "1"})
    assert r.returncode != 0 and "Traceback" in r.stderr.decode()


def test_version_and_help_do_not_load_llama_cpp():
    code = (
        "import sys, contextlib, io\n"
        "from quipu.cli import main\n"
        "for argv in (['--version'], ['--help'], ['run', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        try:\n"
        "            main(argv)\n"
        "        except SystemExit:\n"
        "            pass\n"
        "print('llama_cpp' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.strip() == "False", r.stderr


def test_version(quipu):
    from quipu import __version__

    r = quipu("--version")
    assert r.returncode == 0 and r.stdout.decode().strip() == f"quipu {__version__}"


def test_a_reader_that_leaves_early_ends_the_run_quietly_and_a_whole_answer_arrives_whole(home):
    """`quipu run ... | head -c 1`: exit 0 and nothing on stderr; read to the end, the answer
    and its JSON arrive whole (the process ends without the interpreter's teardown)."""
    import json
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    env["QUIPU_HOME"] = str(home)
    args = [sys.executable, "-m", "quipu", "run", "--seed", "3", "-n", "150", "--logit-bias", "0=-inf", "--logit-bias",
            "2=-inf"]  # (no end-of-text: every run makes its 150 tokens)
    proc = subprocess.Popen([*args, "hello"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    assert proc.stdout.read(1)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0 and err == b"", err.decode()

    plain, as_json = (subprocess.run([*extra, "hello"], stdin=subprocess.DEVNULL, capture_output=True, env=env,
                                     timeout=120) for extra in (args, [*args, "--json"]))
    assert plain.returncode == as_json.returncode == 0, plain.stderr.decode() + as_json.stderr.decode()
    text = json.loads(as_json.stdout)["text"]
    assert len(text) > 20 and plain.stdout.decode().rstrip("\n") == text.rstrip("\n")


def test_ctrl_c_stops_generation_keeps_the_text_and_exits_130(home):
    import os
    import signal

    env = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    env["QUIPU_HOME"] = str(home)
    proc = subprocess.Popen(
        [sys.executable, "-m", "quipu", "run", "-n", "3000", "--seed", "1", "--temperature", "1", "--repeat-penalty", "1.0",
         "--logit-bias", "0=-inf", "--logit-bias", "2=-inf",  # no end-of-text: it cannot end by itself
         "Write a very long essay about the history of every country."],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )
    first = proc.stdout.read(20)  # generation is streaming, and has thousands of tokens to go
    assert first
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()
    assert len(first + rest) > 20
    assert b"Traceback" not in err


def test_a_long_prompt_shows_a_progress_bar_on_a_terminal_stderr_only(home):
    from pty_run import on_a_terminal

    doc = ("The river runs through the valley and every town along it was built at a ford. " * 120).encode()
    code, seen, out = on_a_terminal(home, "run", "-n", "2", "Summarize:", stdout_too=False, stdin=doc)
    assert code == 0
    assert "reading the prompt" in seen
    assert b"reading the prompt" not in out and b"\x1b" not in out


def test_verbose_shows_llama_cpp_s_own_log(quipu, tiny_model):
    quiet = quipu("run", "-m", tiny_model, "-n", "2", "hi")
    loud = quipu("run", "-m", tiny_model, "-n", "2", "--verbose", "hi")
    assert quiet.returncode == loud.returncode == 0
    assert quiet.stderr == b""
    assert b"llama" in loud.stderr and b"Traceback" not in loud.stderr


def test_a_reply_ends_by_itself_or_where_the_context_does_unless_told(quipu, tiny_model):
    # (the tiny model's ends of generation banned: its reply runs on to the context's end, past 512 tokens)
    never = [arg for t in (2, 4, 8, 9, 11, 15, 16, 22, 25, 29) for arg in ("--logit-bias", f"{t}=-inf")]
    r = quipu("run", "-m", tiny_model, "--ctx", "1024", "-t", "0", *never, "--no-cache", "--json", "Hi")
    reply = json.loads(r.stdout)
    assert r.returncode == 0 and reply["finish_reason"] == "context_full"
    assert reply["usage"]["completion_tokens"] > 900
    told = json.loads(quipu("run", "-m", tiny_model, "-n", "7", "-t", "0", *never, "--no-cache", "--json", "Hi").stdout)
    assert told["finish_reason"] == "length" and told["usage"]["completion_tokens"] == 7
