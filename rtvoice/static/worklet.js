// rtvoice demo: the playback jitter buffer, running on the audio rendering thread.
//
// The page posts mono float32 samples at the AudioContext's rate:
//   {type: "push", samples: Float32Array}  append to the ring buffer
//   {type: "end"}                          the turn's audio is complete: play out the tail
//                                          even if it is shorter than the pre-roll
//   {type: "clear"}                        barge-in: drop everything, silence from the next
//                                          render quantum on
// and gets back, every ~20 ms while something changes and at once on clear/underrun/drain:
//   {type: "stats", played, underruns, buffered, playing, quanta, event}
//
// Playback starts once `prerollMs` of audio is buffered (or at "end"). When the buffer runs
// dry before "end" it counts an underrun and waits for the pre-roll again, so a late chunk
// costs one gap instead of a crackle on every quantum.

class JitterBuffer extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const opts = options.processorOptions || {};
    this.preroll = Math.max(1, Math.round(((opts.prerollMs ?? 100) / 1000) * sampleRate));
    this.ring = new Float32Array(Math.round((opts.capacitySeconds ?? 30) * sampleRate));
    this.read = 0; // index of the oldest buffered sample
    this.size = 0; // buffered samples
    this.playing = false; // false: waiting for the pre-roll
    this.ending = false; // "end" received: no more audio is coming for this turn
    this.played = 0; // real samples written to the output (silence not counted)
    this.underruns = 0;
    this.quanta = 0; // render quanta processed: proves the audio thread runs
    this.reportEvery = Math.max(1, Math.round((0.02 * sampleRate) / 128));
    this.dirty = true;
    this.port.onmessage = (e) => this.onMessage(e.data);
  }

  onMessage(msg) {
    if (msg.type === "push") {
      this.push(msg.samples);
    } else if (msg.type === "end") {
      this.ending = true;
      if (this.size === 0) this.drained();
    } else if (msg.type === "clear") {
      this.read = this.size = 0;
      this.playing = this.ending = false;
      this.report("cleared");
    }
  }

  push(x) {
    if (this.size + x.length > this.ring.length) this.grow(this.size + x.length);
    const cap = this.ring.length;
    const w = (this.read + this.size) % cap;
    const first = Math.min(x.length, cap - w);
    this.ring.set(x.subarray(0, first), w);
    this.ring.set(x.subarray(first), 0); // the part that wraps around (may be empty)
    this.size += x.length;
    this.dirty = true;
  }

  // The server generates faster than real time, so a long turn can outgrow the ring: double
  // it (rare; a copy off the hot path of normal turns) rather than drop audio.
  grow(need) {
    let cap = this.ring.length;
    while (cap < need) cap *= 2;
    const ring = new Float32Array(cap);
    ring.set(this.take(this.size));
    this.ring = ring;
    this.read = 0;
  }

  // A copy of the next n buffered samples (not consumed).
  take(n) {
    const out = new Float32Array(n);
    const first = Math.min(n, this.ring.length - this.read);
    out.set(this.ring.subarray(this.read, this.read + first));
    out.set(this.ring.subarray(0, n - first), first);
    return out;
  }

  drained() {
    this.playing = this.ending = false;
    this.report("drained");
  }

  process(inputs, outputs) {
    const out = outputs[0][0];
    this.quanta++;
    if (!this.playing && this.size > 0 && (this.size >= this.preroll || this.ending)) {
      this.playing = true;
    }
    let n = 0;
    if (this.playing) {
      if (this.size < out.length && !this.ending) {
        // Starved mid-turn: play what is left, then rebuffer.
        this.underruns++;
        this.playing = false;
        this.dirty = true;
      }
      n = Math.min(out.length, this.size);
      const first = Math.min(n, this.ring.length - this.read);
      out.set(this.ring.subarray(this.read, this.read + first));
      out.set(this.ring.subarray(0, n - first), first);
      this.read = (this.read + n) % this.ring.length;
      this.size -= n;
      this.played += n;
      if (n) this.dirty = true;
      if (this.size === 0 && this.ending) this.drained();
    }
    out.fill(0, n);
    // Report changes every ~20 ms, and a heartbeat every ~0.5 s (the page checks that the
    // audio thread runs at all: headless browsers may have no output device).
    if (this.quanta % this.reportEvery === 0 && (this.dirty || this.quanta % (25 * this.reportEvery) === 0)) {
      this.report("tick");
    }
    return true; // keep the processor alive between turns
  }

  report(event) {
    this.dirty = false;
    this.port.postMessage({
      type: "stats",
      event,
      played: this.played,
      underruns: this.underruns,
      buffered: this.size,
      playing: this.playing,
      quanta: this.quanta,
    });
  }
}

registerProcessor("jitter-buffer", JitterBuffer);
