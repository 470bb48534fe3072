// rtvoice demo page: one live TTS session over /v1/tts/live (JSON text frames, base64 audio),
// PCM played through an AudioWorklet jitter buffer (worklet.js), barge-in with `cancel`.
// Protocol: docs/PROTOCOL.md. No build step, no dependencies.
"use strict";

// A server started with api_keys: open this page as /?api_key=KEY.
function apiKey() {
  return new URLSearchParams(location.search).get("api_key");
}

const PCM_RATES = [8000, 16000, 22050, 24000, 44100, 48000]; // the server's pcm rates
const FALLBACK_RATE = 44100; // the model's own rate: no resampling on the server
const PREROLL_MS = 100; // jitter buffer filled before playback starts

const $ = (id) => document.getElementById(id);
const now = () => performance.now();

// Everything a test (or a curious developer in the console) may want to read.
const stats = (window.rtvoiceStats = {
  state: "connecting", // connecting | ready | closed | error
  samplesReceived: 0, // samples handed to the worklet (at the AudioContext's rate)
  samplesPlayed: 0, // samples the worklet actually played
  underruns: 0,
  buffered: 0, // samples waiting in the worklet
  playing: false,
  droppedChunks: 0, // audio events ignored because their turn was cancelled
  turns: [], // one record per Speak (see newTurn)
  ready: null, // the server's last `ready` event
  audio: { state: "none", sampleRate: 0, streamRate: 0, running: false, error: null },
  lastInterrupt: null, // {at, samplesPlayed} when Interrupt was last pressed
});

let ws = null; // the WebSocket of the current session
let ctx = null; // AudioContext
let node = null; // AudioWorkletNode (jitter buffer)
let resampler = null; // stream rate -> AudioContext rate, when they differ
let current = null; // the turn being generated or played
let turnCounter = 0;
let sessionCounter = 0; // bumped by connect(): a turn belongs to one session
let clip = null; // {name, base64, text}: an uploaded reference clip in use
let lastQuanta = 0; // worklet heartbeat, to detect an audio thread that never runs

// ------------------------------------------------------------------------------ audio

async function setupAudio() {
  if (!window.AudioContext || !window.AudioWorkletNode) {
    throw new Error(
      window.isSecureContext
        ? "this browser has no Web Audio AudioWorklet"
        : "AudioWorklet needs a secure context: open the page via http://localhost or https",
    );
  }
  ctx = new AudioContext({ latencyHint: "interactive" });
  await ctx.audioWorklet.addModule("/static/worklet.js");
  node = new AudioWorkletNode(ctx, "jitter-buffer", {
    numberOfInputs: 0,
    outputChannelCount: [1],
    processorOptions: { prerollMs: PREROLL_MS, capacitySeconds: 30 },
  });
  node.port.onmessage = (e) => onWorkletStats(e.data);
  node.connect(ctx.destination);
  ctx.onstatechange = updateAudioStatus;
  stats.audio.sampleRate = ctx.sampleRate;
  // Without a user gesture the context may stay suspended (autoplay policy); Speak resumes it.
  ctx.resume().catch(() => {});
  setInterval(checkAudioRunning, 1000);
}

function onWorkletStats(m) {
  stats.samplesPlayed = m.played;
  stats.underruns = m.underruns;
  stats.buffered = m.buffered;
  stats.playing = m.playing;
  lastQuanta = m.quanta;
  stats.audio.running = true;
  if (current && m.event === "drained" && current.doneAt !== null) {
    current.playedAt = now(); // the turn has been heard to its end
    current = null;
    $("interrupt").disabled = true;
  }
  renderMeters();
}

// A context that is "running" but whose worklet never reports has no working output (seen
// with some headless setups); say so instead of silently playing nothing.
let quantaSeen = -1;
function checkAudioRunning() {
  if (ctx.state === "running") stats.audio.running = lastQuanta !== quantaSeen;
  quantaSeen = lastQuanta;
  updateAudioStatus();
}

function updateAudioStatus() {
  const a = stats.audio;
  a.state = ctx ? ctx.state : "none";
  let text = a.error ? "unavailable" : `${a.state}, ${a.sampleRate / 1000} kHz`;
  if (ctx && ctx.state === "suspended") text += " (click Speak)";
  else if (ctx && ctx.state === "running" && !a.running) text = "no output device?";
  $("m-audio").textContent = text;
}

// Streaming linear interpolation from `inRate` to `outRate` (the fallback when the server
// cannot send the AudioContext's rate; the worklet always plays at the context's rate).
class LinearResampler {
  constructor(inRate, outRate) {
    this.step = inRate / outRate; // input samples per output sample
    this.reset();
  }

  reset() {
    this.pos = 1; // next output position; index 0 = last sample of the previous chunk
    this.prev = 0;
  }

  process(x) {
    const last = x.length; // input indices 0..last, 0 being `prev`
    if (this.pos > last) {
      this.pos -= last;
      if (last) this.prev = x[last - 1];
      return new Float32Array(0);
    }
    const n = Math.floor((last - this.pos) / this.step) + 1;
    const out = new Float32Array(n);
    const at = (i) => (i === 0 ? this.prev : x[i - 1]);
    for (let k = 0; k < n; k++) {
      const p = this.pos + k * this.step;
      const i = Math.floor(p);
      const f = p - i;
      out[k] = f ? at(i) * (1 - f) + at(i + 1) * f : at(i);
    }
    this.pos += n * this.step - last;
    this.prev = x[last - 1];
    return out;
  }
}

// base64 s16le mono -> Float32Array in [-1, 1)
function decodePcm(b64) {
  const bin = atob(b64);
  const n = bin.length >> 1; // pcm chunks hold whole samples
  const out = new Float32Array(n);
  for (let i = 0; i < n; i++) {
    let v = bin.charCodeAt(2 * i) | (bin.charCodeAt(2 * i + 1) << 8);
    if (v >= 0x8000) v -= 0x10000;
    out[i] = v / 32768;
  }
  return out;
}

function play(samples) {
  if (!node || !samples.length) return;
  node.port.postMessage({ type: "push", samples }, [samples.buffer]);
}

// ------------------------------------------------------------------------------ session

function streamRate() {
  // `?rate=16000` in the page's URL forces a stream rate (to try the resampler); by default
  // ask for the AudioContext's own rate when the server has it, else the model's rate.
  const forced = Number(new URLSearchParams(location.search).get("rate"));
  if (PCM_RATES.includes(forced)) return forced;
  const rate = ctx ? ctx.sampleRate : FALLBACK_RATE;
  return PCM_RATES.includes(rate) ? rate : FALLBACK_RATE;
}

function connect() {
  if (ws) {
    ws.onclose = ws.onmessage = null; // an old session: its events no longer matter
    ws.close(1000);
  }
  interrupt();
  // Turns of the old session that never got their `done` end here.
  for (const t of stats.turns) if (t.doneAt === null) finishTurn(t, { reason: "closed" });
  setState("connecting");
  const key = apiKey();
  const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/v1/tts/live` +
    (key ? `?api_key=${encodeURIComponent(key)}` : "");
  const sock = (ws = new WebSocket(url));
  sessionCounter++;
  const request = { format: "pcm", sample_rate: streamRate() };
  const voice = $("voice").value;
  if (voice === "clip" && clip) {
    // JSON frames carry bytes as base64 strings (PROTOCOL.md, "Connecting").
    request.references = [{ audio: clip.base64, text: clip.text }];
  } else if (voice && voice !== "clip") {
    request.reference_id = voice;
  }
  sock.onopen = () => {
    sock.send(JSON.stringify({ event: "start", request }));
    log(`→ start ${voice ? `(voice ${voice === "clip" ? clip.name : voice})` : "(default voice)"}, pcm ${request.sample_rate} Hz`);
  };
  sock.onmessage = (m) => onEvent(JSON.parse(m.data));
  sock.onclose = (e) => {
    if (sock !== ws) return;
    setState(stats.state === "error" ? "error" : "closed");
    log(`socket closed (${e.code}${e.reason ? ` ${e.reason}` : ""})`);
    if (current && current.doneAt === null) finishTurn(current, { reason: "error" });
  };
}

function send(event) {
  if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(event));
}

function onEvent(ev) {
  switch (ev.event) {
    case "ready": {
      stats.ready = ev;
      stats.audio.streamRate = ev.sample_rate;
      resampler = ctx && ev.sample_rate !== ctx.sampleRate ? new LinearResampler(ev.sample_rate, ctx.sampleRate) : null;
      setState("ready");
      $("server-info").textContent =
        `model ${ev.model} · pcm ${ev.sample_rate / 1000} kHz${resampler ? ` → ${ctx.sampleRate / 1000} kHz` : ""}` +
        ` · prefill ${ev.prefill_ms.toFixed(0)} ms · session ${ev.session_id}`;
      log(`← ready in ${ev.prefill_ms.toFixed(1)} ms`);
      break;
    }
    case "audio":
      onAudio(ev);
      break;
    case "done": {
      const turn = stats.turns.find((t) => t.contextId === ev.context_id);
      if (turn) finishTurn(turn, ev);
      log(`← done ${ev.context_id}: ${ev.reason}, ttfa ${fmt(ev.ttfa_ms, 0)} ms, ${fmt(ev.audio_s, 2)} s`);
      break;
    }
    case "error":
      log(`← error ${ev.code}: ${ev.message}`);
      banner(`${ev.code}: ${ev.message}`, true);
      if (ev.fatal) setState("error");
      // A rejected text or flush may leave its turn without a `done`: end it here.
      for (const t of stats.turns) {
        if (t.doneAt === null && (ev.fatal || t.contextId === ev.context_id)) finishTurn(t, { reason: "error" });
      }
      break;
    case "finish":
      log(`← finish (${ev.reason})`);
      break;
  }
}

function onAudio(ev) {
  const turn = current;
  // Audio of a cancelled (or superseded) turn that was already in flight: drop it.
  if (!turn || ev.context_id !== turn.contextId || turn.cancelled) {
    stats.droppedChunks++;
    return;
  }
  let samples = decodePcm(ev.audio);
  if (resampler) samples = resampler.process(samples);
  if (turn.firstAudioAt === null) turn.firstAudioAt = now();
  turn.samples += samples.length;
  stats.samplesReceived += samples.length;
  play(samples);
}

// ------------------------------------------------------------------------------ turns

async function speak() {
  const text = $("text").value.trim();
  if (!text || stats.state !== "ready") return;
  if (ctx) ctx.resume().catch(() => {}); // Speak is a user gesture: unlock audio output
  interrupt(); // a new turn replaces whatever is still generating or playing
  if (resampler) resampler.reset(); // each turn is its own stream
  const turn = newTurn(text);
  current = turn;
  stats.turns.push(turn);
  renderTurn(turn);
  $("interrupt").disabled = false;
  if ($("stream").checked) {
    // Like an LLM token stream: one `text` event per word (with its trailing space), paced.
    const pace = Math.max(0, Number($("pace").value) || 0);
    for (const word of text.match(/\S+\s*/g)) {
      if (turn.cancelled || turn.session !== sessionCounter) return;
      send({ event: "text", text: word, context_id: turn.contextId });
      turn.firstTextAt ??= now();
      if (pace) await sleep(pace);
    }
    if (turn.cancelled || turn.session !== sessionCounter) return;
  } else {
    send({ event: "text", text, context_id: turn.contextId });
    turn.firstTextAt = now();
  }
  send({ event: "flush", context_id: turn.contextId });
  turn.flushAt = now();
  log(`→ text ×${$("stream").checked ? text.match(/\S+\s*/g).length : 1}, flush (${turn.contextId})`);
}

function newTurn(text) {
  const id = ++turnCounter;
  return {
    id,
    contextId: `turn-${id}`, // one context per turn: late audio is recognisable by its id
    text,
    session: sessionCounter,
    startedAt: now(),
    firstTextAt: null,
    flushAt: null,
    firstAudioAt: null,
    doneAt: null,
    playedAt: null,
    cancelled: false,
    interrupted: false,
    samples: 0,
    underrunsAtStart: stats.underruns,
    underruns: 0,
    reason: null,
    ttfaServerMs: null,
    ttfaClientMs: null, // flush sent -> first audio received
    audioS: null,
    rtf: null,
    frames: null,
  };
}

// Barge-in: silence now, tell the server, and ignore the turn's audio still in flight.
function interrupt() {
  if (node) node.port.postMessage({ type: "clear" });
  const turn = current;
  current = null;
  $("interrupt").disabled = true;
  if (!turn) return;
  stats.lastInterrupt = { at: now(), samplesPlayed: stats.samplesPlayed, turn: turn.id, turnSamples: turn.samples };
  turn.interrupted = true;
  if (turn.doneAt === null) {
    turn.cancelled = true;
    send({ event: "cancel", context_id: turn.contextId });
    log(`→ cancel (${turn.contextId})`);
  }
  renderTurn(turn);
}

function finishTurn(turn, ev) {
  turn.doneAt = now();
  turn.reason = ev.reason;
  turn.ttfaServerMs = ev.ttfa_ms ?? null;
  turn.audioS = ev.audio_s ?? null;
  turn.rtf = ev.rtf ?? null;
  turn.frames = ev.frames ?? null;
  if (turn.firstAudioAt !== null && turn.flushAt !== null) turn.ttfaClientMs = turn.firstAudioAt - turn.flushAt;
  turn.underruns = stats.underruns - turn.underrunsAtStart;
  if (turn === current) {
    if (node) node.port.postMessage({ type: "end" }); // play out the tail, then "drained"
    if (!turn.samples || !node) current = null; // nothing to wait for
  }
  renderTurn(turn);
  $("interrupt").disabled = !current;
}

// ------------------------------------------------------------------------------ view

function fmt(v, digits) {
  return v === null || v === undefined ? "–" : Number(v).toFixed(digits);
}

function renderTurn(t) {
  let row = $(`turn-row-${t.id}`);
  if (!row) {
    row = document.createElement("tr");
    row.id = `turn-row-${t.id}`;
    $("turns").prepend(row);
  }
  const reason = t.reason ?? (t.cancelled ? "cancelling…" : "speaking…");
  row.className = t.reason ? t.reason : "active";
  const cells = [
    [t.id, "num"],
    [t.text.length > 60 ? `${t.text.slice(0, 57)}…` : t.text, "text"],
    [t.interrupted && t.reason && t.reason !== "cancelled" ? `${reason} (interrupted)` : reason, "reason"],
    [t.ttfaServerMs === null ? "–" : `${fmt(t.ttfaServerMs, 0)} ms`, "num ttfa-server"],
    [clientTtfa(t), "num ttfa-client"],
    [t.audioS === null ? "–" : `${fmt(t.audioS, 2)} s`, "num audio"],
    [fmt(t.rtf, 2), "num rtf"],
    [t.reason ? t.underruns : "–", "num"],
  ];
  row.replaceChildren(
    ...cells.map(([value, cls]) => {
      const td = document.createElement("td");
      td.className = cls;
      td.textContent = String(value);
      if (cls === "text") td.title = t.text;
      return td;
    }),
  );
}

// flush sent -> first audio received. Negative when streamed text completed a sentence and
// audio began before the flush; "before flush" when the turn was cancelled before its flush.
function clientTtfa(t) {
  if (t.ttfaClientMs !== null) return `${fmt(t.ttfaClientMs, 0)} ms`;
  return t.firstAudioAt !== null && t.flushAt === null && t.reason ? "before flush" : "–";
}

let metersPending = false;
function renderMeters() {
  if (metersPending) return; // at most one repaint per animation frame
  metersPending = true;
  requestAnimationFrame(() => {
    metersPending = false;
    const rate = ctx ? ctx.sampleRate : 1;
    $("m-buffered").textContent = `${Math.round((stats.buffered / rate) * 1000)} ms`;
    $("m-played").textContent = `${(stats.samplesPlayed / rate).toFixed(2)} s`;
    $("m-underruns").textContent = String(stats.underruns);
    updateAudioStatus();
  });
}

function setState(state) {
  stats.state = state;
  const pill = $("status");
  pill.textContent = state;
  pill.className = `pill ${state}`;
  $("speak").disabled = state !== "ready";
  if (state === "ready") banner("");
}

function banner(text, isError = false) {
  $("banner").textContent = text;
  $("banner").className = isError ? "banner error" : "banner";
}

function log(line) {
  const el = $("events");
  const t = (now() / 1000).toFixed(3).padStart(9);
  el.textContent = `${el.textContent}${t}  ${line}\n`.split("\n").slice(-200).join("\n");
  el.scrollTop = el.scrollHeight;
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// ------------------------------------------------------------------------------ voices

async function loadVoices() {
  const select = $("voice");
  const keep = select.value;
  try {
    const key = apiKey();
    const res = await fetch("/v1/voices", key ? { headers: { Authorization: `Bearer ${key}` } } : {});
    if (!res.ok) throw new Error(`HTTP ${res.status}`);
    const { voices } = await res.json();
    const options = [new Option("Default voice", "")];
    for (const v of voices) options.push(new Option(`${v.name} (${v.duration_s.toFixed(1)} s)`, v.id));
    if (clip) options.push(new Option(`Uploaded clip: ${clip.name}`, "clip"));
    select.replaceChildren(...options);
    select.value = [...select.options].some((o) => o.value === keep) ? keep : "";
  } catch (err) {
    banner(`could not list voices: ${err.message}`, true);
  }
}

async function useClip() {
  const file = $("ref-file").files[0];
  const text = $("ref-text").value.trim();
  if (!file || !text) {
    banner("choose an audio file and type its transcript first", true);
    return;
  }
  const limit = stats.ready?.limits?.max_message_bytes ?? 8 * 1024 * 1024;
  if (file.size * 1.34 + 4096 > limit) {
    banner(`clip too large: base64 of ${file.size} bytes exceeds the server's ${limit}-byte message limit`, true);
    return;
  }
  const dataUrl = await new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
  clip = { name: file.name, text, base64: dataUrl.slice(dataUrl.indexOf(",") + 1) };
  await loadVoices();
  $("voice").value = "clip";
  connect();
}

// ------------------------------------------------------------------------------ start

async function main() {
  $("speak").onclick = speak;
  $("interrupt").onclick = interrupt;
  $("reconnect").onclick = connect;
  $("voice").onchange = connect;
  $("voice-refresh").onclick = loadVoices;
  $("ref-use").onclick = useClip;
  try {
    await setupAudio();
  } catch (err) {
    stats.audio.error = String(err.message || err);
    banner(`Audio playback unavailable: ${stats.audio.error}. Turns still run; their audio is not played.`, true);
  }
  updateAudioStatus();
  await loadVoices();
  connect();
}

main();
