"""Tests of pylon/logs.py with real log records through real handlers.

A record is made by `logger.info(..., extra=...)` exactly as the service
writes its access line, formatted by the handler, and parsed back.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pylon.logs import (
    NOISY_LOGGERS,
    AccessLog,
    HumanFormatter,
    JsonFormatter,
    configure_logging,
)

ACCESS_FIELDS: dict[str, Any] = {
    "request_id": "r1",
    "backend": "vllm",
    "route": "inference",
    "status": 200,
    "emitted_priority": 7,
    "ttfb_s": 0.012345678,
    "duration_s": 1.5,
    "request_bytes": 120,
    "response_bytes": 4096,
    "error": None,
    "cancelled_by": None,
}


@contextlib.contextmanager
def restored_logging() -> Iterator[None]:
    """Put the root logger and the noisy loggers back as they were (configure_logging
    changes them)."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    noisy = {name: logging.getLogger(name).level for name in NOISY_LOGGERS}
    try:
        yield
    finally:
        root.handlers[:], root.level = saved
        for name, level in noisy.items():
            logging.getLogger(name).setLevel(level)


@pytest.fixture
def root_logging() -> Iterator[None]:
    with restored_logging():
        yield


@contextlib.contextmanager
def configured(
    *, human: bool = False, level: str = "info", stream: io.StringIO | None = None
) -> Iterator[io.StringIO]:
    """configure_logging into a string, the root logger restored afterwards."""
    target = stream if stream is not None else io.StringIO()
    with restored_logging():
        configure_logging(level=level, human=human, stream=target)
        yield target


def lines_of(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(text) for text in stream.getvalue().rstrip("\n").split("\n") if text]


def emit(formatter: logging.Formatter, *, exc: bool = False, **extra: Any) -> str:
    """Log one record through a real logger and handler; return the formatted line."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    logger = logging.getLogger("pylon.access.test")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        if exc:
            try:
                raise RuntimeError("boom")
            except RuntimeError:
                logger.exception("request failed", extra=extra)
        else:
            logger.info("request finished", extra=extra)
    finally:
        logger.removeHandler(handler)
    return stream.getvalue().rstrip("\n")


def test_json_access_line_has_every_field() -> None:
    line = json.loads(emit(JsonFormatter(), **ACCESS_FIELDS))
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line.pop("ts"))
    assert line == {
        "level": "info",
        "logger": "pylon.access.test",
        "msg": "request finished",
        **ACCESS_FIELDS,
    }


def test_json_line_is_one_line_and_serializes_anything() -> None:
    text = emit(JsonFormatter(), where=Path("/tmp/x"), note="two\nlines")
    assert "\n" not in text
    line = json.loads(text)
    assert (line["where"], line["note"]) == ("/tmp/x", "two\nlines")


def test_json_line_carries_the_exception() -> None:
    line = json.loads(emit(JsonFormatter(), exc=True, request_id="r2"))
    assert line["level"] == "error" and line["request_id"] == "r2"
    assert "RuntimeError: boom" in line["exc"]


def test_human_line_is_readable_and_skips_empty_fields() -> None:
    text = emit(HumanFormatter(), **ACCESS_FIELDS)
    assert text.startswith("info    pylon.access.test: request finished request_id=r1 ")
    assert "status=200" in text and "emitted_priority=7" in text
    assert "ttfb_s=0.0123457" in text
    assert "cancelled_by" not in text and "error" not in text


@pytest.mark.parametrize("formatter", [JsonFormatter(), HumanFormatter()])
def test_bodies_are_never_logged(formatter: logging.Formatter) -> None:
    text = emit(
        formatter,
        body=b"SECRET-PROMPT",
        request_body="SECRET-PROMPT",
        messages=[{"role": "user", "content": "SECRET-PROMPT"}],
        chunk=b"SECRET-TOKEN",
        request_id="r3",
    )
    assert "SECRET" not in text
    assert "<12 bytes>" in text and "r3" in text


@pytest.mark.usefixtures("root_logging")
def test_configure_logging_json_at_the_configured_level() -> None:
    stream = io.StringIO()
    configure_logging(level="warning", human=False, stream=stream)
    logging.getLogger("pylon.access").info("dropped", extra={"request_id": "r4"})
    logging.getLogger("pylon").warning("kept", extra={"request_id": "r5"})
    (line,) = [json.loads(text) for text in stream.getvalue().splitlines()]
    assert (line["msg"], line["request_id"], line["level"]) == ("kept", "r5", "warning")


@pytest.mark.usefixtures("root_logging")
def test_configure_logging_human_for_dev_and_quiet_libraries() -> None:
    stream = io.StringIO()
    configure_logging(level="debug", human=True, stream=stream)
    logging.getLogger("pylon.priority").debug("engine priority 5 emitted")
    logging.getLogger("httpx").info("HTTP Request: GET /health")
    assert stream.getvalue() == "debug   pylon.priority: engine priority 5 emitted\n"
    assert logging.getLogger("httpx").level == logging.WARNING


def test_configure_logging_rejects_an_unknown_level() -> None:
    with pytest.raises(ValueError, match="log level"):
        configure_logging(level="verbose", human=False)


@given(st.lists(st.floats(min_value=0, max_value=4e9), min_size=1, max_size=20))
def test_json_timestamps_match_strftime_in_any_order(created: list[float]) -> None:
    """The formatter keeps the current second's text; each line still gets its own time."""
    formatter = JsonFormatter()
    for moment in sorted(created) + created:  # in order, then jumping back and forth
        record = logging.makeLogRecord({"msg": "m"})
        record.created = moment
        record.msecs = (moment - int(moment)) * 1000
        expected = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(moment))
        expected += f".{int(record.msecs):03d}Z"
        assert json.loads(formatter.format(record))["ts"] == expected


# --- the access line -----------------------------------------------------------------

_FIELD_NAMES = st.text(st.characters(codec="ascii", categories=["Ll", "Nd"]), min_size=1).filter(
    lambda name: name not in vars(logging.makeLogRecord({})) and name not in ("message", "asctime")
)
_FIELD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(),
    st.binary(max_size=40),
)


@given(st.dictionaries(_FIELD_NAMES, _FIELD_VALUES, max_size=12))
def test_access_line_written_directly_is_the_line_logging_writes(fields: dict[str, Any]) -> None:
    """Same keys, values and order; only the time may differ (two clock readings)."""
    logger = logging.getLogger("pylon.access.direct")
    with configured() as stream:
        AccessLog(logger, "request finished").write(fields)
        logger.info("request finished", extra=dict(fields))
    direct, through_logging = stream.getvalue().rstrip("\n").split("\n")
    pattern = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"
    assert re.fullmatch(pattern, json.loads(direct)["ts"])
    assert re.sub(pattern, "T", direct) == re.sub(pattern, "T", through_logging)


def test_access_line_skips_the_record_when_logging_would_only_write_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    logger = logging.getLogger("pylon.access.direct")

    def no_record(*args: Any, **kwargs: Any) -> logging.LogRecord:
        raise AssertionError("a record was made")

    monkeypatch.setattr(logger, "makeRecord", no_record)
    with configured() as stream:
        AccessLog(logger, "request finished").write(ACCESS_FIELDS)
    (line,) = lines_of(stream)
    assert line["logger"] == "pylon.access.direct" and line["request_id"] == "r1"


def test_access_line_goes_through_logging_when_a_filter_is_on_the_way() -> None:
    logger = logging.getLogger("pylon.access.direct")
    seen: list[logging.LogRecord] = []

    def keep_errors_only(record: logging.LogRecord) -> bool:
        seen.append(record)
        return getattr(record, "status", 0) >= 500

    logger.addFilter(keep_errors_only)
    try:
        with configured() as stream:
            AccessLog(logger, "request finished").write(ACCESS_FIELDS)
            AccessLog(logger, "request finished").write({**ACCESS_FIELDS, "status": 502})
    finally:
        logger.removeFilter(keep_errors_only)
    assert [record.status for record in seen] == [200, 502]  # type: ignore[attr-defined]
    assert [line["status"] for line in lines_of(stream)] == [502]


def test_access_line_reaches_every_handler_and_the_human_format() -> None:
    logger = logging.getLogger("pylon.access.direct")
    extra_stream = io.StringIO()
    extra_handler = logging.StreamHandler(extra_stream)
    logger.addHandler(extra_handler)
    try:
        with configured() as stream:
            AccessLog(logger, "request finished").write(ACCESS_FIELDS)
    finally:
        logger.removeHandler(extra_handler)
    assert extra_stream.getvalue() == "request finished\n"
    assert [line["request_id"] for line in lines_of(stream)] == ["r1"]
    with configured(human=True) as stream:
        AccessLog(logger, "request finished").write(ACCESS_FIELDS)
    human_line = "info    pylon.access.direct: request finished request_id=r1"
    assert stream.getvalue().startswith(human_line)


def test_access_line_below_the_level_and_bodies_are_not_written() -> None:
    logger = logging.getLogger("pylon.access.direct")
    with configured(level="warning") as stream:
        AccessLog(logger, "request finished").write(ACCESS_FIELDS)
    assert stream.getvalue() == ""
    with configured() as stream:
        AccessLog(logger, "request finished").write(
            {"body": "SECRET-PROMPT", "chunk": b"SECRET-TOKEN", "request_id": "r6"}
        )
    (line,) = lines_of(stream)
    assert line["chunk"] == "<12 bytes>" and "body" not in line and line["request_id"] == "r6"


def test_access_line_write_error_is_reported_by_logging_not_raised(
    capsys: pytest.CaptureFixture[str],
) -> None:
    class Broken(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError("disk full")

    logger = logging.getLogger("pylon.access.direct")
    with configured(stream=Broken()):
        AccessLog(logger, "request finished").write(ACCESS_FIELDS)
    assert "OSError: disk full" in capsys.readouterr().err


def test_access_line_goes_through_logging_when_the_handler_has_a_filter() -> None:
    logger = logging.getLogger("pylon.access.direct")
    with configured() as stream:
        (handler,) = logging.getLogger().handlers
        handler.addFilter(lambda record: getattr(record, "status", 0) != 200)
        AccessLog(logger, "request finished").write(ACCESS_FIELDS)
        AccessLog(logger, "request finished").write({**ACCESS_FIELDS, "status": 404})
    assert [line["status"] for line in lines_of(stream)] == [404]


def test_access_line_follows_a_formatter_set_on_the_handler() -> None:
    logger = logging.getLogger("pylon.access.direct")
    with configured() as stream:
        (handler,) = logging.getLogger().handlers
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        AccessLog(logger, "request finished").write(ACCESS_FIELDS)
    assert stream.getvalue() == "INFO request finished\n"
