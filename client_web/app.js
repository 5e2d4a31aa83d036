// MOSS-Speech voice chat page: WebRTC audio both ways, events on the `oai-events` data channel.
// Standard browser APIs only (Chrome and Firefox); no build step.
"use strict";

const $ = (id) => document.getElementById(id);

// Answer-track RMS (float samples in [-1, 1]) above which we count audio as "arrived". Opus silence decodes to
// exact zeros; -50 dBFS sits well above codec noise and below any voice.
const LEVEL_THRESHOLD = 0.003;
const LEVEL_POLL_MS = 10;
// Microphone RMS above which the user is speaking (-40 dBFS: above a quiet room through the browser's noise
// suppression, below a voice). The moment it falls back under it is when the user stopped talking, as they feel it.
const MIC_SPEECH_LEVEL = 0.01;

// Exposed for tests and for curious users (open the console): everything the page measures.
const stats = {
  infoLoaded: false,
  randomWeights: null,
  connected: false,
  callId: null,
  state: "idle",
  micLevel: 0,
  outLevel: 0,
  maxOutLevel: 0,
  ttfaMs: [], // speech_stopped received -> answer audible
  feltMs: [], // the mic's level fell to silence -> answer audible (what the user feels: the detector's wait too)
  serverTtfaMs: [],
  events: {},
  errors: [],
  turns: 0,
};
window.__mossStats = stats;

let info = null;
let pc = null;
let dc = null;
let micStream = null;
let audioCtx = null;
let pollTimer = null;
let turnStart = null; // performance.now() when the current turn was committed; cleared at first audio
let micSpeaking = false; // the mic's level is above MIC_SPEECH_LEVEL
let micSilentSince = null; // performance.now() when it last fell below, while it stays below
let turnSpeechEnd = null; // micSilentSince when the current turn ended; cleared at first audio
let speaking = false;
let answerOpen = false; // a response is in flight (created, not yet done)
let voiceWavPending = null; // ArrayBuffer chosen before the call started
const bubbles = new Map(); // response id -> transcript element

// ---- UI helpers --------------------------------------------------------------------------------

function showError(msg) {
  const el = $("error");
  el.textContent = msg;
  el.hidden = !msg;
  if (msg) stats.errors.push(msg);
}

function setState(s) {
  stats.state = s;
  const el = $("state");
  el.textContent = s;
  el.className = "state state-" + s.split(" ")[0];
}

function addLine(who, text, key) {
  const div = document.createElement("div");
  div.className = "line " + who;
  const label = document.createElement("span");
  label.className = "who";
  label.textContent = who === "user" ? "you" : who === "assistant" ? "model" : who;
  const body = document.createElement("span");
  body.className = "body";
  body.textContent = text;
  div.append(label, body);
  $("transcript").append(div);
  $("transcript").scrollTop = $("transcript").scrollHeight;
  if (key) bubbles.set(key, body);
  return body;
}

function appendToAnswer(responseId, delta) {
  let body = bubbles.get(responseId);
  if (!body) body = addLine("assistant", "", responseId);
  body.textContent += delta;
  $("transcript").scrollTop = $("transcript").scrollHeight;
}

function setConnectedUi(on) {
  $("connect").disabled = on;
  $("hangup").disabled = !on;
  for (const id of ["text-input", "text-send", "apply", "commit"]) $(id).disabled = !on;
}

// ---- server info -------------------------------------------------------------------------------

async function loadInfo() {
  try {
    const r = await fetch("v1/info", { cache: "no-store" });
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    info = await r.json();
  } catch (e) {
    showError(`Cannot reach the server at ${location.origin} (${e.message}). Is \`moss-speech serve\` running?`);
    return false;
  }
  stats.infoLoaded = true;
  stats.randomWeights = !!info.random_weights;
  $("model").textContent = `model: ${info.model}`;
  $("random-notice").hidden = !info.random_weights;
  offerTurnDetection(info.turn_detection);
  return true;
}

// Turn detection the server does not serve is greyed out; the choice falls to the next one it does (the
// end-of-turn model ends turns soonest, then the VAD's silence, then push to talk).
function offerTurnDetection(served) {
  if (!Array.isArray(served)) return;
  const select = $("turn-detection");
  for (const option of select.options) option.disabled = option.value !== "none" && !served.includes(option.value);
  if (select.selectedOptions[0].disabled) {
    select.value = ["semantic_vad", "server_vad"].find((t) => served.includes(t)) || "none";
  }
  showTurnSettings();
}

// Only the chosen turn detection's own setting can be changed: eagerness, or the VAD's silence.
function showTurnSettings() {
  const kind = $("turn-detection").value;
  $("eagerness").disabled = kind !== "semantic_vad";
  $("vad-silence").disabled = kind !== "server_vad";
}

// ---- microphone --------------------------------------------------------------------------------

async function openMic() {
  if (!window.isSecureContext || !navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) {
    throw new Error("The microphone needs a secure page: open this page over HTTPS or on http://localhost.");
  }
  try {
    return await navigator.mediaDevices.getUserMedia({
      audio: { echoCancellation: true, noiseSuppression: true, autoGainControl: true, channelCount: 1 },
      video: false,
    });
  } catch (e) {
    if (e.name === "NotAllowedError" || e.name === "SecurityError") {
      throw new Error("Microphone access was denied. Allow the microphone for this site (the icon in the " +
        "address bar) and press Connect again.");
    }
    if (e.name === "NotFoundError" || e.name === "OverconstrainedError") {
      throw new Error("No microphone was found. Plug one in and press Connect again.");
    }
    if (e.name === "NotReadableError") {
      throw new Error("The microphone is in use by another application or could not be opened.");
    }
    throw new Error(`Could not open the microphone: ${e.name}: ${e.message}`);
  }
}

// ---- levels and time to the answer ------------------------------------------------------------

function startLevels(remoteStream) {
  // Chrome only feeds a remote WebRTC stream into WebAudio while a media element also plays it, so the
  // <audio> element plays and the analyser only listens (it is not connected to the speakers).
  const mk = (stream) => {
    const a = audioCtx.createAnalyser();
    a.fftSize = 512;
    audioCtx.createMediaStreamSource(stream).connect(a);
    return { a, buf: new Float32Array(a.fftSize) };
  };
  const mic = mk(micStream);
  const out = mk(remoteStream);
  clearInterval(pollTimer);
  pollTimer = setInterval(() => {
    stats.micLevel = rms(mic.a, mic.buf);
    stats.outLevel = rms(out.a, out.buf);
    const now = performance.now();
    if (stats.micLevel > MIC_SPEECH_LEVEL) {
      micSpeaking = true;
      micSilentSince = null;
    } else if (micSpeaking) {
      micSpeaking = false;
      micSilentSince = now;
    }
    stats.maxOutLevel = Math.max(stats.maxOutLevel, stats.outLevel);
    $("mic-level").value = Math.min(1, stats.micLevel * 5);
    $("out-level").value = Math.min(1, stats.outLevel * 5);
    if (stats.outLevel > LEVEL_THRESHOLD) onAnswerAudible();
  }, LEVEL_POLL_MS);
}

function onAnswerAudible() {
  if (turnStart !== null) {
    const now = performance.now();
    stats.ttfaMs.push(now - turnStart);
    stats.feltMs.push(turnSpeechEnd === null ? null : now - turnSpeechEnd);
    turnStart = turnSpeechEnd = null;
    showLatency(stats);
  }
  if (!speaking && answerOpen) {
    speaking = true;
    setState("speaking");
  }
}

function markTurnEnd(spoken) {
  turnStart = performance.now();
  // A spoken turn ended where the mic went quiet (if it is quiet now: else the level never fell to silence)
  turnSpeechEnd = spoken && !micSpeaking ? micSilentSince : null;
  stats.turns += 1;
  setState("thinking");
}

// ---- events ------------------------------------------------------------------------------------

function send(ev) {
  if (!dc || dc.readyState !== "open") {
    showError("Not connected: the event channel is not open.");
    return false;
  }
  dc.send(JSON.stringify(ev));
  return true;
}

function sessionConfig() {
  const modality = $("modality").value;
  const kind = $("turn-detection").value;
  const td = kind === "server_vad"
    ? { type: "server_vad", silence_duration_ms: Number($("vad-silence").value) }
    : kind === "semantic_vad" ? { type: "semantic_vad", eagerness: $("eagerness").value } : null;
  return {
    type: "realtime",
    output_modalities: [modality],
    instructions: $("instructions").value.trim() || null,
    audio: { input: { turn_detection: td }, output: { speed: Number($("speed").value) } },
    // Sampling is not part of the Realtime GA session; the server takes it under its own extension key.
    moss: { sampling: { temperature: Number($("temperature").value), top_p: Number($("top-p").value) } },
  };
}

function onEvent(ev) {
  stats.events[ev.type] = (stats.events[ev.type] || 0) + 1;
  switch (ev.type) {
    case "session.created":
      setState("listening");
      if (ev.session && ev.session.moss && ev.session.moss.random_weights) $("random-notice").hidden = false;
      send({ type: "session.update", session: sessionConfig() });
      break;
    case "input_audio_buffer.speech_started":
      if (!speaking) setState("listening (you are speaking)");
      break;
    case "input_audio_buffer.speech_stopped":
      addLine("user", "(spoken turn)");
      markTurnEnd(true);
      break;
    case "response.created":
      answerOpen = true;
      break;
    case "output_audio_buffer.started":
      onAnswerAudible();
      break;
    case "output_audio_buffer.stopped":
    case "output_audio_buffer.cleared":
      speaking = false;
      if (!answerOpen) setState("listening");
      break;
    case "response.output_audio_transcript.delta":
    case "response.output_text.delta":
      appendToAnswer(ev.response_id, ev.delta);
      if (ev.type === "response.output_text.delta" && turnStart !== null && $("modality").value === "text") {
        // A text answer has no audio: its first token is the "first output" of the turn.
        stats.ttfaMs.push(performance.now() - turnStart);
        stats.feltMs.push(turnSpeechEnd === null ? null : performance.now() - turnSpeechEnd);
        turnStart = turnSpeechEnd = null;
        showLatency(stats);
      }
      break;
    case "response.done": {
      answerOpen = false;
      const r = ev.response || {};
      const t = r.moss && r.moss.ttfa_ms != null ? r.moss.ttfa_ms : r.ttfa_ms;
      if (t != null) {
        stats.serverTtfaMs.push(t);
        $("ttfa-server").textContent = `${Math.round(t)} ms`;
      }
      if (r.status === "failed") showError(`The answer failed: ${JSON.stringify(r.status_details || {})}`);
      if (!speaking) setState("listening");
      break;
    }
    case "error": {
      const e = ev.error || {};
      showError(`Server error${e.code ? " (" + e.code + ")" : ""}: ${e.message || "unknown"}`);
      break;
    }
    default:
      break;
  }
}

// ---- call lifecycle ----------------------------------------------------------------------------

function waitIceGathering(conn, timeoutMs) {
  // aiortc does not take trickled candidates: the offer must carry them all.
  if (conn.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const t = setTimeout(resolve, timeoutMs);
    conn.addEventListener("icegatheringstatechange", () => {
      if (conn.iceGatheringState === "complete") {
        clearTimeout(t);
        resolve();
      }
    });
  });
}

async function connect() {
  showError("");
  $("connect").disabled = true;
  setState("connecting");
  try {
    if (!info && !(await loadInfo())) throw new Error($("error").textContent);
    micStream = await openMic();
    audioCtx = new (window.AudioContext || window.webkitAudioContext)();
    await audioCtx.resume();

    pc = new RTCPeerConnection({ iceServers: info.ice_servers || [] });
    pc.addTrack(micStream.getAudioTracks()[0], micStream);
    dc = pc.createDataChannel("oai-events");
    dc.onmessage = (m) => {
      try {
        onEvent(JSON.parse(m.data));
      } catch (e) {
        console.error("bad event", e, m.data);
      }
    };
    dc.onopen = () => {
      stats.connected = true;
      setConnectedUi(true);
      if (voiceWavPending) uploadVoice(voiceWavPending);
    };
    pc.ontrack = (e) => {
      const stream = e.streams[0] || new MediaStream([e.track]);
      const audio = $("remote-audio");
      audio.srcObject = stream;
      audio.play().catch(() => {});
      startLevels(stream);
    };
    pc.onconnectionstatechange = () => {
      if (!pc) return;
      if (pc.connectionState === "failed") {
        showError("The audio connection failed (ICE). From another machine the server needs a reachable " +
          "address or a TURN server; see the README.");
        hangup(false);
      } else if (pc.connectionState === "disconnected") {
        setState("reconnecting");
      } else if (pc.connectionState === "connected" && stats.state === "reconnecting") {
        setState("listening");
      }
    };

    await pc.setLocalDescription(await pc.createOffer());
    await waitIceGathering(pc, 3000);
    let r;
    try {
      r = await fetch("v1/realtime/calls", {
        method: "POST",
        headers: { "Content-Type": "application/sdp" },
        body: pc.localDescription.sdp,
      });
    } catch (e) {
      throw new Error(`Cannot reach the server at ${location.origin}: ${e.message}`);
    }
    if (!r.ok) {
      let msg = `HTTP ${r.status}`;
      try {
        const j = await r.json();
        msg = (j.error && j.error.message) || msg;
      } catch (_) { /* not JSON */ }
      throw new Error(`The server refused the call: ${msg}`);
    }
    const loc = r.headers.get("Location") || "";
    stats.callId = loc.split("/").pop() || null;
    await pc.setRemoteDescription({ type: "answer", sdp: await r.text() });
  } catch (e) {
    showError(e.message);
    await hangup(false);
  }
}

async function hangup(userAction = true) {
  const callId = stats.callId;
  clearInterval(pollTimer);
  pollTimer = null;
  if (dc) dc.close();
  if (pc) pc.close();
  if (micStream) micStream.getTracks().forEach((t) => t.stop());
  if (audioCtx) audioCtx.close().catch(() => {});
  pc = dc = micStream = audioCtx = null;
  stats.connected = false;
  stats.callId = null;
  speaking = answerOpen = micSpeaking = false;
  turnStart = turnSpeechEnd = micSilentSince = null;
  setConnectedUi(false);
  setState("idle");
  if (callId) {
    // Frees the server's peer at once instead of waiting for its ICE consent check to time out.
    await fetch(`v1/realtime/calls/${callId}/hangup`, { method: "POST", keepalive: true }).catch(() => {});
  }
  if (userAction) showError("");
}

async function uploadVoice(buf) {
  if (!stats.callId) {
    voiceWavPending = buf;
    return;
  }
  try {
    const r = await fetch(`v1/realtime/calls/${stats.callId}/voice`, {
      method: "POST",
      headers: { "Content-Type": "audio/wav" },
      body: buf,
    });
    if (!r.ok) {
      const j = await r.json().catch(() => ({}));
      throw new Error((j.error && j.error.message) || `HTTP ${r.status}`);
    }
    voiceWavPending = null;
    addLine("system", "voice prompt set");
  } catch (e) {
    showError(`Voice prompt upload failed: ${e.message}`);
  }
}

// ---- wiring ------------------------------------------------------------------------------------

window.addEventListener("DOMContentLoaded", () => {
  setConnectedUi(false);
  showTurnSettings();
  loadInfo();
  $("turn-detection").addEventListener("change", showTurnSettings);
  $("connect").addEventListener("click", connect);
  $("hangup").addEventListener("click", () => hangup(true));
  $("apply").addEventListener("click", () => send({ type: "session.update", session: sessionConfig() }));
  $("commit").addEventListener("click", () => {
    if (send({ type: "input_audio_buffer.commit" }) && send({ type: "response.create" })) {
      addLine("user", "(spoken turn)");
      markTurnEnd(true);
    }
  });
  $("voice-file").addEventListener("change", async (e) => {
    const f = e.target.files[0];
    if (f) uploadVoice(await f.arrayBuffer());
  });
  $("text-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("text-input").value.trim();
    if (!text) return;
    const item = { type: "message", role: "user", content: [{ type: "input_text", text }] };
    // Push to talk: the live mic keeps filling the input buffer; the server clears that uncommitted mic audio
    // when this answer is asked for (input_audio_buffer.cleared), so a typed turn drops what was said but not
    // committed. A clear sent from here would race the mic frames still in flight.
    if (send({ type: "conversation.item.create", item }) && send({ type: "response.create" })) {
      addLine("user", text);
      $("text-input").value = "";
      markTurnEnd();
    }
  });
  window.addEventListener("pagehide", () => {
    if (stats.callId) navigator.sendBeacon(`v1/realtime/calls/${stats.callId}/hangup`);
  });
});
