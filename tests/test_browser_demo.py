"""The browser demo page (``rtvoice/static``) driven in headless Chromium against a real server.

Needs Selenium and Debian's ``chromium`` + ``chromium-driver``; skipped (with the reason) when
any of them is missing. The page exposes ``window.rtvoiceStats`` (samples received/played by
the AudioWorklet jitter buffer, underruns, one record per turn), which is what is checked here:

- the page loads, lists the stored voices and connects (``ready``);
- with an inline reference clip (base64 in JSON) and a forced 16 kHz stream, a turn plays
  through the page's resampler at the AudioContext's rate;
- with a stored voice, a turn plays to its end (every received sample reaches the output) and
  its TTFA (server and client) is shown;
- a barge-in mid-turn silences playback at once (``samplesPlayed`` stops growing), the server
  answers ``done`` ``cancelled``, late audio of that turn is dropped, and the next turn plays.

A screenshot of the page is saved to ``artifacts/browser_demo.png``.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _audio import wav_bytes

from rtvoice.testing import running_server

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select  # noqa: E402

pytestmark = pytest.mark.timeout(180)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"

LONG_TEXT = " ".join(
    ["Well, there is a lot to say about this, so let me start at the very beginning."]
    + ["The history of the place, its people, its food and its music all matter here."] * 8
)




@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    # Short turns stay short (the frame budget follows the text: 1x its expected duration).
    with running_server(budget_multiplier=1.0, min_turn_frames=8) as url:
        yield url


@pytest.fixture(scope="module")
def voice_id(server: str) -> str:
    """A voice in the server's store, added through the REST API."""
    res = httpx.post(
        f"{server}/v1/voices",
        files={"audio": ("clip.wav", wav_bytes(1.0), "audio/wav")},
        data={"transcript": "A short reference clip.", "name": "stored voice"},
        timeout=60,
    )
    assert res.status_code == 201, res.text
    return res.json()["id"]


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium "
                    "chromium-driver): /usr/bin/chromium or /usr/bin/chromedriver not found")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",  # the machine has no network: no update checks
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--autoplay-policy=no-user-gesture-required",  # AudioContext runs without a click
        f"--user-data-dir={tmp_path_factory.mktemp('chromium')}",
        "--window-size=1100,1150",
    ):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver path: Selenium Manager (which would go online) is not used.
    driver = webdriver.Chrome(options=opts, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


# ------------------------------------------------------------------------------ helpers


def stats(driver: Any) -> dict[str, Any]:
    return driver.execute_script("return window.rtvoiceStats")


def diagnose(driver: Any) -> str:
    """What the page knows, for a failure message."""
    s = stats(driver) or {}
    s.pop("ready", None)
    events = driver.find_element(By.ID, "events").text
    logs = [e["message"] for e in driver.get_log("browser")]
    return f"stats={json.dumps(s, default=str)}\nevents:\n{events}\nconsole: {logs}"


def wait_for(driver: Any, condition: str, what: str, timeout: float = 15.0) -> dict[str, Any]:
    """Poll the JS expression ``condition`` (``s`` = rtvoiceStats) until it is truthy."""
    deadline = time.monotonic() + timeout
    while True:
        if driver.execute_script(f"const s = window.rtvoiceStats; return !!(s && ({condition}));"):
            return stats(driver)
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}\n{diagnose(driver)}")
        time.sleep(0.05)


def open_page(driver: Any, url: str) -> dict[str, Any]:
    driver.get(url)
    s = wait_for(driver, "s.state === 'ready'", "the page to connect (ready)")
    assert driver.find_element(By.ID, "status").text == "ready"
    audio = s["audio"]
    assert audio["error"] is None, f"the page reports no audio playback: {audio['error']}"
    # Headless Chromium plays into a null sink; if even that does not run, say it plainly.
    wait_for(driver, "s.audio.state === 'running' && s.audio.running",
             "the AudioContext to run (headless Chromium without a working audio output?)", 5)
    return s


def set_text(driver: Any, text: str) -> None:
    driver.execute_script("document.getElementById('text').value = arguments[0];", text)


def speak_and_play(driver: Any, text: str) -> dict[str, Any]:
    """One turn heard to its end; returns the turn's record."""
    n = len(stats(driver)["turns"])
    set_text(driver, text)
    driver.find_element(By.ID, "speak").click()
    s = wait_for(driver, f"s.turns.length > {n} && s.turns[{n}].playedAt !== null",
                 "the turn to be generated and played to its end", 20)
    return s["turns"][n]


# ------------------------------------------------------------------------------ the tests

# worklet.js's processor driven by hand, one 128-sample render quantum at a time, outside the
# audio thread (stubs stand in for the AudioWorkletGlobalScope): pre-roll, a write that wraps
# around the ring, a ring that grows while wrapped, an underrun and rebuffering, "end" playing
# a tail shorter than the pre-roll, and "clear".
WORKLET_SCENARIO = """
const done = arguments[arguments.length - 1];
window.sampleRate = 1280;  // 128 samples = 100 ms
window.AudioWorkletProcessor = class { constructor() { this.port = {reports: [],
    postMessage(m) { this.reports.push(m); }}; } };
window.registerProcessor = (name, cls) => { window.JitterBufferClass = cls; };
const script = document.createElement("script");
script.src = "/static/worklet.js";
script.onerror = () => done({error: "worklet.js did not load"});
script.onload = () => {
  const p = new window.JitterBufferClass({processorOptions: {prerollMs: 100, capacitySeconds: 0.2}});
  const seq = (a, b) => Float32Array.from({length: b - a + 1}, (_, i) => (a + i) / 2048);
  const push = (a, b) => p.onMessage({type: "push", samples: seq(a, b)});
  const out = [];
  const quantum = () => { const o = new Float32Array(128); p.process([], [[o]]); out.push(...o); };
  push(1, 64); quantum();                  // below the pre-roll: silence
  push(65, 200); quantum();                // 1..128
  push(201, 350);                          // wraps around the 256-sample ring
  push(351, 450);                          // outgrows it: the ring doubles while wrapped
  const capacity = p.ring.length;
  quantum(); quantum(); quantum();         // 129..450, then starved: an underrun
  push(451, 500); quantum();               // rebuffering: silence
  p.onMessage({type: "end"}); quantum();   // the tail plays without the pre-roll
  push(501, 1000); quantum();              // 501..628
  p.onMessage({type: "clear"}); quantum(); // silence at once
  done({out: out.map((v) => Math.round(v * 2048)), capacity, played: p.played,
        underruns: p.underruns, buffered: p.size,
        events: p.port.reports.map((r) => r.event).filter((e) => e !== "tick")});
};
document.head.append(script);
"""


def test_worklet_jitter_buffer(browser: Any, server: str) -> None:
    browser.get(f"{server}/")
    r = browser.execute_async_script(WORKLET_SCENARIO)
    assert "error" not in r, r
    zeros = [0] * 128
    expected = (zeros + list(range(1, 129)) + list(range(129, 451)) + [0] * 62 + zeros
                + list(range(451, 501)) + [0] * 78 + list(range(501, 629)) + zeros)
    assert r["out"] == expected
    assert r["capacity"] == 512
    assert (r["played"], r["underruns"], r["buffered"]) == (628, 1, 0)
    assert r["events"] == ["drained", "cleared"]




def test_browser_demo(browser: Any, server: str, voice_id: str, tmp_path: Path) -> None:
    t0 = time.monotonic()
    driver = browser

    # --- static files are served ------------------------------------------------------
    for path, kind in (("/", "text/html"), ("/static/app.js", "javascript"),
                       ("/static/worklet.js", "javascript")):
        res = httpx.get(server + path, timeout=10)
        assert res.status_code == 200 and kind in res.headers["content-type"], path

    # --- an inline reference clip, 16 kHz stream resampled in the page -------------------
    s = open_page(driver, f"{server}/?rate=16000")
    first_session = s["ready"]["session_id"]
    rate = s["audio"]["sampleRate"]
    clip = tmp_path / "clip.wav"
    clip.write_bytes(wav_bytes(1.5, 16000))
    driver.find_element(By.ID, "ref-file").send_keys(str(clip))
    driver.find_element(By.ID, "ref-text").send_keys("A short reference clip.")
    driver.find_element(By.ID, "ref-use").click()
    s = wait_for(driver, f"s.state === 'ready' && s.ready.session_id !== '{first_session}'",
                 "a new session with the uploaded clip")
    assert s["ready"]["sample_rate"] == 16000 and s["audio"]["streamRate"] == 16000
    assert Select(driver.find_element(By.ID, "voice")).first_selected_option.text.startswith(
        "Uploaded clip: clip.wav")
    turn = speak_and_play(driver, "Hello there. This is a cloned voice.")
    assert turn["reason"] in ("eos", "length") and turn["samples"] > 0
    # 16 kHz from the server, resampled to the AudioContext's rate by the page.
    assert turn["samples"] == pytest.approx(turn["audioS"] * rate, rel=0.02)

    # --- a stored voice, the AudioContext's own rate --------------------------------------
    s = open_page(driver, server)
    select = Select(driver.find_element(By.ID, "voice"))
    assert [o.text for o in select.options][:1] == ["Default voice"]
    assert any(o.get_attribute("value") == voice_id for o in select.options)
    session = s["ready"]["session_id"]
    select.select_by_value(voice_id)  # a new session with that voice
    s = wait_for(driver, f"s.state === 'ready' && s.ready.session_id !== '{session}'",
                 "a new session with the stored voice")
    assert s["ready"]["reference_id"] == voice_id
    assert s["audio"]["streamRate"] == s["audio"]["sampleRate"]  # no resampling needed

    turn = speak_and_play(driver, "Hello there. How are you today?")
    s = stats(driver)
    assert turn["reason"] in ("eos", "length")
    assert s["samplesPlayed"] > 0 and s["samplesPlayed"] == s["samplesReceived"]
    assert turn["samples"] == pytest.approx(turn["audioS"] * rate, rel=0.01)
    assert turn["ttfaServerMs"] > 0 and turn["ttfaClientMs"] > 0 and turn["rtf"] > 0
    row = driver.find_element(By.ID, f"turn-row-{turn['id']}")
    assert row.find_element(By.CSS_SELECTOR, ".ttfa-server").text.endswith(" ms")
    assert row.find_element(By.CSS_SELECTOR, ".ttfa-client").text.endswith(" ms")

    # --- barge-in: word-by-word streaming of a long text, interrupted mid-turn ----------
    driver.find_element(By.ID, "stream").click()
    pace = driver.find_element(By.ID, "pace")
    pace.clear()
    pace.send_keys("15")
    set_text(driver, LONG_TEXT)
    played_before = s["samplesPlayed"]
    driver.find_element(By.ID, "speak").click()
    s = wait_for(driver, f"s.samplesPlayed > {played_before + int(0.5 * rate)}",
                 "0.5 s of the long turn to play")
    turn = s["turns"][-1]
    assert turn["reason"] is None, "the long turn ended before the barge-in"
    driver.find_element(By.ID, "interrupt").click()
    clicked = time.monotonic()
    at_click = wait_for(driver, "s.lastInterrupt !== null && s.lastInterrupt.turn === "
                        f"{turn['id']}", "the interrupt")["lastInterrupt"]
    time.sleep(max(0.0, 0.2 - (time.monotonic() - clicked)))
    after_200ms = stats(driver)
    time.sleep(0.5)
    after_700ms = stats(driver)
    # Silence at once: at most one report period (~20 ms) of audio after the click, nothing
    # after 200 ms, and the buffer is empty.
    assert after_200ms["samplesPlayed"] - at_click["samplesPlayed"] < 0.2 * rate, diagnose(driver)
    assert after_700ms["samplesPlayed"] == after_200ms["samplesPlayed"], diagnose(driver)
    assert after_700ms["buffered"] == 0 and not after_700ms["playing"]
    s = wait_for(driver, f"s.turns[{len(s['turns']) - 1}].reason !== null",
                 "done for the cancelled turn")
    cancelled = s["turns"][-1]
    assert cancelled["reason"] == "cancelled" and cancelled["cancelled"]
    # Not a sample of it was taken after the interrupt (late chunks are dropped).
    assert cancelled["samples"] == at_click["turnSamples"]
    # nothing played beyond what arrived before the interrupt (on a loaded machine the player
    # may have caught up with a starved stream, so everything that arrived may have played;
    # that the turn was cut short is its reason, checked above, with none before the click)
    assert s["samplesPlayed"] - played_before <= cancelled["samples"]
    row = driver.find_element(By.ID, f"turn-row-{cancelled['id']}")
    assert row.find_element(By.CSS_SELECTOR, ".reason").text == "cancelled"

    # --- the next turn on the same socket plays normally --------------------------------
    driver.find_element(By.ID, "stream").click()  # back to one text event
    session = s["ready"]["session_id"]
    turn = speak_and_play(driver, "Sure. It is nine o'clock.")
    assert turn["reason"] in ("eos", "length") and turn["samples"] > 0
    s = stats(driver)
    assert s["ready"]["session_id"] == session and s["state"] == "ready"
    # Every sample received was played, except the part of the cancelled turn that was cut.
    cut = cancelled["samples"] - (after_700ms["samplesPlayed"] - played_before)
    assert s["samplesPlayed"] == s["samplesReceived"] - cut

    ARTIFACTS.mkdir(exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / "browser_demo.png"))
    severe = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not severe, severe
    tail_ms = (after_200ms["samplesPlayed"] - at_click["samplesPlayed"]) / rate * 1000
    print(f"browser demo: {time.monotonic() - t0:.1f} s; {tail_ms:.0f} ms played after Interrupt")
