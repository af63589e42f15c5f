"""Redaction: canaries never survive, ordinary arguments do, and nothing raises on odd input."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectors import redact as redact_module
from collectors.redact import REDACTED, RedactionEngine, is_secret_name, redact_argv, redact_argv_counts, redact_text

CANARY = "CANARYs3cr3tVALUE9876"
OPENAI = "sk-proj-" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4"
HF = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz123456"
GHP = "ghp_" + "0123456789abcdefghijABCDEFGHIJ012345"
AWS = "AKIA" + "IOSFODNN7EXAMPLE"
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--api-key", CANARY],
        ["serve", f"--api-key={CANARY}"],
        ["serve", "--token", CANARY],
        ["serve", "--hf-token", CANARY],
        ["serve", "--password", CANARY],
        ["serve", f"--db-password={CANARY}"],
        ["serve", "--secret", CANARY],
        ["serve", "--client-secret", CANARY],
        ["serve", "--auth", CANARY],
        ["serve", "--authorization", CANARY],
        ["serve", "--credentials", CANARY],
        ["serve", "-token", CANARY],  # Go-style single-dash long flag
        ["serve", "--apiKey", CANARY],
        ["env", f"HF_TOKEN={CANARY}", "python", "serve.py"],
        ["env", f"OPENAI_API_KEY={CANARY}", "python"],
        ["env", f"PGPASSWORD={CANARY}", "psql"],
        ["env", f"SECRET_KEY_BASE={CANARY}", "rails"],
        ["curl", "-H", f"Authorization: Bearer {CANARY}", "http://127.0.0.1/"],
        ["curl", "-H", "Authorization:", "Bearer", CANARY],
        ["curl", "-H", f"Authorization: Basic {CANARY}"],
        ["curl", "-H", f"authorization: {CANARY}"],
        ["tool", "bearer", CANARY],
        ["psql", f"postgres://admin:{CANARY}@db:5432/app"],
        ["git", "clone", f"https://x-access-token:{CANARY}@github.com/o/r"],
        ["serve", f"--db=postgresql://u:{CANARY}@h/db"],
        ["serve", f"--url=http://h/?api_key={CANARY}&x=1"],
        ["serve", "--config", f'{{"password": "{CANARY}"}}'],
        ["serve", OPENAI],
        ["serve", HF],
        ["serve", GHP],
        ["serve", AWS],
        ["serve", JWT],
        ["serve", f"--weird={OPENAI}"],
    ],
)
def test_secret_values_never_survive(argv: list[str]) -> None:
    out = redact_argv(argv)
    for secret in (CANARY, OPENAI, HF, GHP, AWS, JWT):
        assert secret not in out
    assert REDACTED in out
    assert out.split(" ")[0] == argv[0]  # the program name is kept


@pytest.mark.parametrize(
    "argv",
    [
        ["python", "-m", "llama_cpp.server", "--model", "/m.gguf", "--port", "8000"],
        ["vllm", "serve", "--max-tokens", "5", "--max-model-len", "4096", "--tokenizer", "/tok"],
        ["setxkbmap", "--keyboard", "us"],
        ["serve", "--key-file", "/etc/ssl/key.pem", "--ssl-keyfile", "/k.pem", "--auth-type", "basic"],
        ["serve", "--token-limit", "100", "--num-keys", "3", "--max-new-tokens", "64"],
        ["env", "TOKENIZERS_PARALLELISM=false", "OMP_NUM_THREADS=1", "python", "x.py"],
        ["env", "AWS_ACCESS_KEY_ID_FILE=/run/id", "PWD=/srv", "python"],
        ["ssh", "git@github.com"],
        ["serve", "--use-auth-token", "--model", "m"],  # a flag followed by a flag takes no value
        ["serve", "--detokenize", "on", "--monkey", "patch"],
    ],
)
def test_ordinary_arguments_survive(argv: list[str]) -> None:
    assert redact_argv(argv) == " ".join(argv)


def test_only_the_value_goes() -> None:
    assert redact_argv(["serve", "--api-key", CANARY, "--port", "8000"]) == "serve --api-key <redacted> --port 8000"
    assert redact_argv(["serve", f"--api-key={CANARY}"]) == "serve --api-key=<redacted>"
    assert redact_argv(["env", f"HF_TOKEN={CANARY}", "x"]) == "env HF_TOKEN=<redacted> x"


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("HF_TOKEN", True),
        ("OPENAI_API_KEY", True),
        ("AWS_SECRET_ACCESS_KEY", True),
        ("hf_token", True),
        ("apiKey", True),
        ("DB_PASSWD", True),
        ("PGPASSWORD", True),
        ("GOOGLE_APPLICATION_CREDENTIALS_JSON", True),
        ("AUTH", True),
        ("API_KEY_2", True),
        ("TOKENIZERS_PARALLELISM", False),
        ("MAX_TOKENS", False),
        ("KEYBOARD", False),
        ("PATH", False),
        ("PWD", False),
        ("AWS_ACCESS_KEY_ID", False),
        ("SSL_KEY_FILE", False),
        ("", False),
    ],
)
def test_is_secret_name(name: str, secret: bool) -> None:
    assert is_secret_name(name) is secret


def test_redact_text_counts_per_rule() -> None:
    text = "\n".join(
        [
            f"connecting to postgres://app:{CANARY}@db/app",
            f"Authorization: Bearer {CANARY}",
            f"using key {OPENAI} and {HF}",
            f'config: {{"api_key": "{CANARY}", "max_tokens": 5}}',
            f"argv: serve --password {CANARY} --port 8000",
            "-----BEGIN PRIVATE KEY-----",
            CANARY,
            "-----END PRIVATE KEY-----",
        ]
    )
    out, counts = redact_text(text)
    assert CANARY not in out and OPENAI not in out and HF not in out
    assert counts == {
        "private_key": 1,
        "url_credentials": 1,
        "bearer": 1,
        "token_openai": 1,
        "token_huggingface": 1,
        "key_value": 1,
        "flag_value": 1,
    }
    assert '"max_tokens": 5' in out and "--port 8000" in out


def test_a_harmless_pair_does_not_hide_a_secret_one() -> None:
    out, counts = redact_text(f"a=password={CANARY}&token={CANARY}")
    assert CANARY not in out
    assert counts == {"key_value": 2}


def test_redaction_is_stable_when_applied_twice() -> None:
    once, _ = redact_text(f"token={CANARY} Authorization: Bearer {CANARY}")
    twice, counts = redact_text(once)
    assert twice == once
    assert counts == {}


def test_argv_counts() -> None:
    _, counts = redact_argv_counts(["serve", "--api-key", CANARY, HF])
    assert counts == {"flag_value": 1, "token_huggingface": 1}


_secret_flags = st.sampled_from(["--api-key", "--token", "--password", "--secret", "--auth-token", "--hf_token"])
_plain = st.text(alphabet=st.characters(codec="utf-8"), max_size=30)


@settings(max_examples=200, deadline=None)
@given(before=st.lists(_plain, max_size=5), flag=_secret_flags, after=st.lists(_plain, max_size=5), joined=st.booleans())
def test_canary_after_a_secret_flag_never_survives(before: list[str], flag: str, after: list[str], joined: bool) -> None:
    argv = [*before, f"{flag}={CANARY}"] if joined else [*before, flag, CANARY]
    assert CANARY not in redact_argv([*argv, *after])


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400))
def test_redact_text_never_raises(text: str) -> None:
    out, counts = redact_text(text)
    assert all(isinstance(v, int) and v > 0 for v in counts.values())
    if not counts:
        assert out == text  # no rule fired: the text is left exactly as it was


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=40), max_size=12))
def test_redact_argv_never_raises(argv: list[str]) -> None:
    out, counts = redact_argv_counts(argv)
    assert out == redact_argv(argv)
    if not counts:
        assert out == " ".join(argv)  # nothing secret: joined for display like ps, nothing else changed


# --------------------------------------------------------------------------- the linear engine


def _reference():
    """The engine before it became linear (kept in bench/ as a frozen copy), loaded by path."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "redact_reference.py"
    spec = importlib.util.spec_from_file_location("redact_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REFERENCE = _reference()

# Pieces that exercise every rule, glued by generated text: the two engines must agree on the lot.
_FRAGMENTS = [
    "token",
    "TOKEN",
    "api_key",
    "apiKey",
    "max_tokens",
    "password",
    "PGPASSWORD",
    "passphrase",
    "auth",
    "Authorization",
    "auth_type",
    "key_file",
    "tokenizer",
    "monkey",
    "Bearer",
    "bearer",
    "Basic",
    "cookie",
    "creds",
    "pwd",
    "PWD",
    "=",
    ":",
    ": ",
    '="',
    '"',
    "'",
    '":',
    "&",
    ",",
    ";",
    "}",
    "]",
    ")",
    " ",
    "  ",
    "\t",
    "\n",
    "-",
    "--",
    "--api-key",
    "--token",
    "-token",
    "--max-tokens",
    "://",
    "http://",
    "postgres://",
    "u:p@",
    "user:pw@",
    "@",
    "/",
    "sk-",
    "hf_",
    "ghp_",
    "gho_",
    "github_pat_",
    "glpat-",
    "AKIA",
    "ASIA",
    "xoxb-",
    "xoxp-",
    "AIza",
    "eyJ",
    ".eyJ",
    ".",
    "-----BEGIN ",
    "RSA ",
    "PRIVATE KEY-----",
    "-----END ",
    "<redacted>",
    "ab12CD34ef56GH78ij90",
    "0123456789",
    "ABCDEFGHIJKLMNOP",
    "x",
    "_",
    "9",
    "é",
    "K",
    "İ",
]
_ordinary = st.lists(
    st.one_of(st.sampled_from(_FRAGMENTS), st.text(alphabet=st.characters(codec="utf-8"), max_size=12)), max_size=40
).map("".join)


# Settings and flags glued together: most of these texts have something to redact.
_pair = st.tuples(
    st.sampled_from(["", " ", "\n", "&", ",", "{", '"', "--", "-", "9", "x.", "a=", "_"]),
    st.sampled_from(["token", "api_key", "password", "max_tokens", "Authorization", "auth_type", "PWD", "cookie", "k"]),
    st.sampled_from(["=", ": ", '": ', "= ", " ", "\t", '="', "='", ":"]),
    st.one_of(st.sampled_from(["Bearer", "Basic", "<redacted>", '"', "'", "", "x y", "sk-" + "a" * 22]), st.text(max_size=10)),
).map("".join)
_dense = st.lists(st.one_of(_pair, st.sampled_from(_FRAGMENTS)), max_size=12).map("".join)


@settings(max_examples=600, deadline=None)
@given(st.one_of(_ordinary, _dense))
def test_linear_engine_gives_the_old_output_and_counts(text: str) -> None:
    assert redact_text(text) == REFERENCE.redact_text(text)


@settings(max_examples=200, deadline=None)
@given(st.lists(_ordinary.map(lambda s: s[:60]), max_size=10))
def test_linear_engine_gives_the_old_argv(argv: list[str]) -> None:
    assert redact_argv_counts(argv) == REFERENCE.redact_argv_counts(argv)


GITLAB = "glpat-" + "Ab1Cd2Ef3Gh4Ij5Kl6Mn"
SLACK = "xoxb-" + "1234567890-abcdefABCDEF"
GOOGLE = "AIza" + "SyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q"
GITHUB_PAT = "github_pat_" + "11ABCDEFG0123456789_abcdefghijklmnop"
PEM = "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA" + CANARY + "\n-----END RSA PRIVATE KEY-----"
# The credential shapes detect-secrets and gitleaks look for, each in a setting where nothing names it.
SHAPES = [OPENAI, HF, GHP, GITHUB_PAT, "github_pat_" + "1" * 30, GITLAB, SLACK, GOOGLE, AWS, "ASIA" + "Y34FZKBOKMUTVV7A", JWT]


@pytest.mark.parametrize("secret", SHAPES)
@pytest.mark.parametrize("noise", ["", "a" * 30_000, "sk-" * 5_000, "x=" * 5_000, "eyJ" * 5_000])
def test_shapes_never_survive_next_to_adversarial_words(secret: str, noise: str) -> None:
    for text in (f"{noise} {secret} {noise}", f"{noise}\n{secret}", f"{secret}\n{noise}"):
        out, counts = redact_text(text)
        assert secret not in out
        assert counts


@pytest.mark.parametrize(
    "text",
    [
        PEM,
        f"postgres://admin:{CANARY}@db/app",
        f"Authorization: Bearer {CANARY}",
        f'{{"client_secret": "{CANARY}"}}',
        f"export OPENAI_API_KEY={CANARY}",
        f"--hf-token {CANARY}",
        f"Cookie: {CANARY}",
    ],
)
def test_named_secrets_never_survive_in_a_long_text(text: str) -> None:
    long = ("a" * 20_000 + " ") + text + (" " + "b" * 20_000)
    out, _ = redact_text(long)
    assert CANARY not in out


def _cpu(fn, arg, reps: int = 5) -> float:
    """Least CPU time of ``reps`` calls: the figure least disturbed by other jobs on the machine."""
    import time

    best = float("inf")
    for _ in range(reps):
        t0 = time.process_time()
        fn(arg)
        best = min(best, time.process_time() - t0)
    return best


_ADVERSARIAL_UNITS = [
    "a",
    "aB",
    "sk-",
    "hf_",
    "ghp_",
    "eyJ",
    "eyJaaaaaaaaa.",
    "AKIA",
    "xoxb-",
    "AIza",
    "=",
    "a=",
    "a:b",
    "key",
    "a.b-",
    "http://",
    "a://b",
    "-----BEGIN ",
    "Bearer ",
    "--token ",
    'password="',
    "token=x&",
]


@pytest.mark.parametrize("unit", _ADVERSARIAL_UNITS)
def test_redaction_work_grows_linearly(unit: str) -> None:
    """Doubling the input twice (20k -> 80k characters) multiplies the work by about 4 when linear and by 16 when
    quadratic; measured side by side (CPU time, best of several), the bound of 9 separates the two with room for
    noise and asserts no absolute time."""
    sizes = [20_000, 40_000, 80_000]
    texts = [(unit * (n // len(unit) + 1))[:n] for n in sizes]
    _cpu(redact_text, texts[0], reps=1)  # warm caches
    times = [_cpu(redact_text, t) for t in texts]
    assert times[2] <= 9 * max(times[0], 1e-4), (unit, times)
    argv_times = [_cpu(redact_argv, ["serve", "--config", t]) for t in (texts[0], texts[2])]
    assert argv_times[1] <= 9 * max(argv_times[0], 1e-4), (unit, argv_times)


@pytest.mark.parametrize(
    "text",
    [
        "github_pat_" + "1" * 30,  # no "gh" inside: the quick no-trigger check must still see it
        "token=\"'''''bearer'''''\" abc",  # a quoted scheme with extra quotes inside is still a scheme
        "auth=Negotiate abc auth=BASIC  x",
        "a=password=x&token=y",
        "x" * 600 + " token=abc Authorization: Bearer q",  # past the short-text path
    ],
)
def test_linear_engine_agrees_on_edge_cases(text: str) -> None:
    assert redact_text(text) == REFERENCE.redact_text(text)
    assert redact_argv_counts(text.split(" ")) == REFERENCE.redact_argv_counts(text.split(" "))


# Settings glued densely, with the values the one-split path must hand to the general loop (a scheme word, an
# unclosed or lone quote, a value already redacted) and more distinct secret names than that path takes.
_setting = st.tuples(
    st.sampled_from(["", " ", "\n", "&", ",", "{", '"', "'", "--", "-", "9", "x.", "a=", "_", "é", "K"]),
    st.sampled_from(
        ["token", "api_key", "password", "max_tokens", "Authorization", "auth_type", "PWD", "cookie", "k", "Token",
         "x-token", "9token", ".key", "apiKey", "secret", *(f"token{i}" for i in range(20))]
    ),
    st.sampled_from(["=", ": ", '": ', "= ", " ", "\t", '="', "='", ":", "'=", '" : ', "=\t"]),
    st.one_of(
        st.sampled_from(["Bearer", "Basic", "NEGOTIATE z", "<redacted>", "<redacted>x", "Bearer <redacted>",
                         "token <redacted>", '"', "'", "", "x y", '"x"', "'x'", '"x\n', '"bearer"', "\"'bearer'\"",
                         "sk-" + "a" * 22]),
        st.text(max_size=10),
    ),
).map("".join)  # fmt: skip


_PATHS = ("chosen", "named", "marked", "unmarked")


def _engine(path: str, **tuning: int) -> RedactionEngine:
    """A fresh engine that takes one way of redacting settings: "named" (a pattern of the text's secret names,
    normally only for many settings per name), "marked" (secret settings marked by a character absent from the
    text, then one split), "unmarked" (the pattern that judges every name itself, used when every mark is in
    the text), or "chosen" (the engine's own choice). Fresh, so it judges every name anew."""
    if path == "named":
        return RedactionEngine(fast_names_max=10**6, fast_min_settings_per_name=0, **tuning)
    if path == "marked":
        return RedactionEngine(fast_names_max=0, **tuning)
    if path == "unmarked":
        return RedactionEngine(fast_names_max=0, marks=(), **tuning)
    return RedactionEngine(**tuning)


@settings(max_examples=400, deadline=None)
@given(st.lists(_setting, max_size=40).map("".join), st.sampled_from(_PATHS))
def test_dense_settings_give_the_old_output_and_counts(text: str, path: str) -> None:
    assert _engine(path).redact_text(text) == REFERENCE.redact_text(text)


@pytest.mark.parametrize(
    "text",
    [
        "token=abc&" * 50,  # one name many times: the one-split path
        '"password": "x", ' * 50,
        "token=Bearer abc&token=x",  # a scheme word: the general loop
        "token=<redacted>&token=x",  # already redacted: left as is, the next one still goes
        "token=\"abc\ntoken='x'",  # unclosed quote
        "token='",  # a lone quote at the end
        "".join(f"token{i}=v{i}&" for i in range(40)),  # more distinct names than the one-split path takes
        "monkey=password=x&token=y",  # a non-secret name's value still holds a secret setting
        "apiKey=1 api_key=2 API_KEY=3 9token=4 .key=5",
        "Authorization: Bearer <redacted>\nAuthorization: Bearer x",  # a scheme before a redacted secret is left
        "auth=Basic <redacted>token=x",  # ... unless the value runs on into another setting
        "auth=Basic <redacted>",
        "auth=Basic  <redacted> auth=Basic <redacted>, auth=token <redacted>&",
        "auth=Basic <redacted>auth=x",
    ],
)
@pytest.mark.parametrize("path", _PATHS)
def test_settings_paths_agree_with_the_old_engine(text: str, path: str) -> None:
    assert _engine(path).redact_text(text) == REFERENCE.redact_text(text)


@pytest.mark.parametrize("name", ["token", "a" * 100 + "token", "a" * 10_000 + "token"])
def test_settings_work_grows_linearly(name: str) -> None:
    """Many settings of one (possibly very long) secret name: the same 9x bound as above for 4x the input."""
    texts = [(f"{name}=x&" * (n // (len(name) + 3) + 1))[:n] for n in (20_000, 80_000)]
    _cpu(redact_text, texts[0], reps=1)
    times = [_cpu(redact_text, t) for t in texts]
    assert times[1] <= 9 * max(times[0], 1e-4), (name[-10:], times)
    assert all("x&" not in redact_text(t)[0] for t in texts)


# --------------------------------------------------------------------------- names judged by a pattern

# Words and near-misses of secret words, in every spelling a name can have, glued by separators and digits:
# what decides a name (a secret word, a strong suffix, a descriptor last, camelCase word breaks, "pwd").
_NAME_PIECES = [
    *("token", "TOKEN", "Token", "toKen", "tokens", "TOKENS", "Tokenizer", "mytoken", "MYTOKEN", "hfToken"),
    *("key", "KEY", "Key", "apiKey", "APIKey", "APIKEY", "Apikey", "monkey", "hotkey", "keyboard", "KEYAb", "KEYS"),
    *("password", "PASSWORD", "passwd", "pass", "word", "WORD", "pwd", "PWD", "Pwd", "old", "OLD", "oldpwd"),
    *("secret", "SECRETS", "clientsecret", "credential", "Credentials", "creds", "cred", "passphrase"),
    *("auth", "AUTH", "Author", "authorization", "bearer", "cookie", "Cookies", "session"),
    *("file", "FILE", "File", "path", "id", "ID", "Id", "ids", "url", "URL", "len", "type", "enabled", "prefix"),
    *("a", "A", "x", "X", "ab", "AB", "Ab", "e", "y", "K", "k", "s", "S"),
    *("_", ".", "-", "0", "9", "12"),
]
_names = st.lists(st.sampled_from(_NAME_PIECES), min_size=1, max_size=7).map("".join)
_name_chars = st.text(alphabet="kKeEyYtToOnNpPaAsSwWdDfFiIlLcCrRhHbB_.-09", min_size=1, max_size=16)


def _expected_run_is_secret(run: str) -> bool:
    """The plain reading: the name is the run from its first letter or "_", judged by is_secret_name."""
    start = 0
    while start < len(run) and run[start] in "0123456789.-":
        start += 1
    return start < len(run) and is_secret_name(run[start:])


@settings(max_examples=3000, deadline=None)
@given(st.one_of(_names, _name_chars))
def test_the_name_pattern_judges_as_is_secret_name(run: str) -> None:
    assert redact_module._run_is_secret(run) == _expected_run_is_secret(run), run


@pytest.mark.parametrize(
    ("run", "secret"),
    [
        ("token0", True),
        ("TOKENS", False),  # one word, "tokens", not a secret word
        ("KEYAb", True),  # KEY, Ab
        ("KEYa", False),  # KE, Ya
        ("password_monkey", True),  # the secret word is not the last root
        ("tokenmonkey", False),
        ("api_key_file", False),
        ("keyFILE", False),
        ("KEYFile", False),
        ("1-pwd", False),
        ("a1pwd", True),
        ("oldPwd", False),
        ("x" * 5000 + "_token", True),
        ("token_" + "x1" * 5000, True),
    ],
)
def test_the_name_pattern_on_chosen_names(run: str, secret: bool) -> None:
    assert redact_module._run_is_secret(run) is secret
    assert _expected_run_is_secret(run) is secret


def test_only_the_kelvin_sign_lowers_into_an_ascii_letter() -> None:
    """The scheme words are matched letter by letter with the characters whose ``lower()`` is that letter; the
    pattern adds the Kelvin sign to "k" and nothing else, which is right only while no other character lowers
    into an ASCII letter."""
    import string
    import sys

    odd = {chr(c) for c in range(128, sys.maxunicode + 1) if chr(c).lower() in set(string.ascii_lowercase)}
    assert odd == {"\u212a"}
    assert redact_text("auth=to\u212aen abc") == REFERENCE.redact_text("auth=to\u212aen abc")


# Settings with names that are secret, near misses of secret names, and all different (more than the named
# pattern takes), next to unicode and to the characters that mark settings.
_near_setting = st.tuples(
    st.sampled_from(["", " ", "\n", "&", ",", "{", '"', "'", "-", "9", "x.", "a=", "é", "\u212a", "İ", "\x00", "\ufdd0"]),
    st.one_of(_names, st.integers(0, 10**6).map(lambda i: f"token{i}"), st.sampled_from(["k", "Token", "token"])),
    st.sampled_from(["=", ": ", '": ', "= ", " ", '="', "='", ":", "'=", '" : ', "=\t", "\x00="]),
    st.one_of(
        st.sampled_from(["Bearer", "to\u212aen x", "basic <redacted>", "Bearer <redacted>x", '"bearer" q', "'\"basic\"' q",
                         '"token"', "token'", "<redacted>", '"', "'", "", "x y", '"x\n', "sk-" + "a" * 22, "\x00x"]),
        st.text(max_size=8),
    ),
).map("".join)  # fmt: skip


@settings(max_examples=500, deadline=None)
@given(st.lists(_near_setting, max_size=30).map("".join), st.sampled_from(_PATHS))
def test_settings_of_near_miss_and_distinct_names_give_the_old_output(text: str, path: str) -> None:
    assert _engine(path).redact_text(text) == REFERENCE.redact_text(text)


@pytest.mark.parametrize(
    "text",
    [
        "token0: token'=Basic",  # a scheme that is also the name of the next setting
        '"token10" : "token" : "x"',  # ... inside quotes
        'token37= "token": "x.k" y',
        "token=abc=password=x&token1=y",
        "\x00token=x \x01password=y \ufdd0key=z",  # the first marks are in the text: the next free one is used
        "".join(f"token{i}=abc&" for i in range(2000)),  # distinct secret names, none repeated
        "".join(f"token{i}: Bearer x{i}\n" for i in range(300)),
        "".join(f'"TOKENS{i}": "a", "apiKey{i}": "b", ' for i in range(300)),  # near misses next to secrets
        "x" * 3000 + "token=" + "y" * 3000 + " password=z",
    ],
)
@pytest.mark.parametrize("path", _PATHS)
def test_settings_paths_agree_on_long_and_marked_texts(text: str, path: str) -> None:
    assert _engine(path).redact_text(text) == REFERENCE.redact_text(text)


def test_every_mark_in_the_text_still_redacts() -> None:
    """A text holding every mark character takes the pattern that needs none."""
    marks = "".join(redact_module._MARKS)
    text = marks + "".join(f"token{i}=abc{i}&" for i in range(100))
    out, counts = redact_text(text)
    assert counts == {"key_value": 100}
    assert "abc" not in out
    assert (out, counts) == REFERENCE.redact_text(text)


@pytest.mark.parametrize("cache_max", [1, 3, 8, 4096])
@pytest.mark.parametrize("path", _PATHS)
def test_a_full_memory_of_judged_names_loses_no_secret(cache_max: int, path: str) -> None:
    """Names judged before (remembered) next to new ones, with the memory of judged names filling up and
    emptied on the way: each text still gives the old engine's output."""
    engine = _engine(path, name_cache_max=cache_max)
    texts = [
        "token=a&password=b&x=c",
        "token=a&password=b&key1=c&key2=d&key3=e&key4=f",
        "".join(f"token{i}=v&" for i in range(20)) + "token=a&password=b",
        "password=b&monkey=c&token=a&" + "".join(f"name{i}=v&" for i in range(20)),
    ]
    for _ in range(2):
        for text in texts:
            assert engine.redact_text(text) == REFERENCE.redact_text(text), (cache_max, text)


# --------------------------------------------------------------------------- scans from one separator, rule characters

# Fewer separators than one in 16 characters: the names come from two scans, one per separator, not one split.
_SPARSE = "x " * 200


@pytest.mark.parametrize(
    "text",
    [
        _SPARSE + "token=a " + _SPARSE + "password: b " + _SPARSE,  # both separators: the names of both scans
        _SPARSE + "password: b " + _SPARSE + "token=a " + _SPARSE,
        _SPARSE + "password: b " + _SPARSE,  # ":" only
        _SPARSE + "token=a " + _SPARSE,  # "=" only
        "".join(f"key{i}: v{i}, " for i in range(50)) + "token=a",  # dense, both: the split from either separator
        "".join(f"key{i}: v{i}, " for i in range(50)),  # dense, ":" only
        "".join(f"key{i}=v{i}&" for i in range(50)),  # dense, "=" only
        "token=a&" * 40 + "password: b",  # many settings of a few names (the named path), both separators
    ],
)
@pytest.mark.parametrize("path", _PATHS)
def test_names_after_either_separator_are_found(text: str, path: str) -> None:
    """Each secret setting is redacted whichever separator it has and whichever other separators the text holds."""
    out, counts = _engine(path).redact_text(text)
    assert (out, counts) == REFERENCE.redact_text(text)
    assert "a " not in out.replace(_SPARSE, "") and "b " not in out.replace(_SPARSE, "")
    assert not any(f"v{i}," in out or f"v{i}&" in out for i in range(50))


@pytest.mark.parametrize("secret", [*SHAPES, PEM])
@pytest.mark.parametrize("context", ["{}", "{} --api-key x", "a=1 {} b: 2", "{}\n" + "ab " * 300])
def test_each_rule_fires_with_only_its_own_characters(secret: str, context: str) -> None:
    """A rule is skipped when a character it cannot fire without is absent: each shape, alone or among
    characters the other rules look for, still goes."""
    text = context.format(secret)
    out, counts = redact_text(text)
    assert (out, counts) == REFERENCE.redact_text(text)
    assert secret not in out and counts


@pytest.mark.parametrize("text", ["--token abc", "-password abc", "x --api-key abc y", "--token\tabc"])
def test_flags_are_found_without_other_characters(text: str) -> None:
    out, counts = redact_text(text)
    assert (out, counts) == REFERENCE.redact_text(text)
    assert "abc" not in out and counts == {"flag_value": 1}


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--model", "m", "--api-key", "v1", "--port", "1", OPENAI, "-H", "Authorization:", "Bearer", "v2"],
        [HF, "--port", "1", "--password", "v1", "x", "bearer", "v2"],  # the first literal present is not in every hot one
        ["serve", "--hf-token", "v1", "--x", "Authorization:", "v2", AWS, "--secret"],
        ["a", "b", "--token", "<redacted>", "auth=v1", "x", JWT, "--api-key"],
    ],
)
def test_argv_with_several_literals_gives_the_old_output(argv: list[str]) -> None:
    """Arguments that hold different literals (each its own): every one of them is looked at."""
    out, counts = redact_argv_counts(argv)
    assert (out, counts) == REFERENCE.redact_argv_counts(argv)
    assert "v1" not in out and "v2" not in out


@pytest.mark.parametrize(
    "text",
    [
        "".join(f"token{i}=v{i}&" for i in range(300)),  # every name secret (dense): every setting marked at once
        "".join(f"token{i}: v{i}" + " x" * 20 + "\n" for i in range(100)),  # ... sparse
        "".join(f"token{i}=v{i}&" for i in range(300)) + "tokens=keep",  # all but one: the per-name table
        "tokens=keep&" + "".join(f"token{i}=v{i}&" for i in range(300)),
    ],
)
@pytest.mark.parametrize("path", ["chosen", "marked"])
def test_marking_every_name_or_all_but_one(text: str, path: str) -> None:
    out, counts = _engine(path).redact_text(text)
    assert (out, counts) == REFERENCE.redact_text(text)
    assert "keep" in out or "keep" not in text
    assert not any(f"v{i}&" in out or f"v{i} " in out for i in range(300))


def test_no_pattern_repeats_a_group_possessively() -> None:
    """CPython before 3.11.5 (Debian 12 ships 3.11.2) matches a possessive repeat of a group wrongly: with
    ``(?:...|...)*+`` the secret-name run found nothing and ``--api-key=VALUE`` went out unredacted. The
    same meaning is written as an atomic group around a greedy repeat; this keeps it so on any Python."""
    import re

    import collectors.redact as redact

    patterns = [v for v in vars(redact).values() if isinstance(v, re.Pattern)]
    patterns += [p for v in vars(redact).values() if isinstance(v, dict) for p in v.values() if isinstance(p, re.Pattern)]
    assert len(patterns) >= 5
    for pattern in patterns:
        assert not re.search(r"\)(?:[*+?]|\{\d*,?\d*\})\+", pattern.pattern), pattern.pattern[:120]
