// What the voice chat page shows of its latency: levels from an analyser, the figures of the last turns and their
// chart. Plain functions of the page's `stats` (app.js); loaded before app.js.
"use strict";

const CHART_TURNS = 20;

// RMS of an analyser's current window (float samples in [-1, 1]); `buf` is reused between polls.
function rms(analyser, buf) {
  analyser.getFloatTimeDomainData(buf);
  let s = 0;
  for (let i = 0; i < buf.length; i++) s += buf[i] * buf[i];
  return Math.sqrt(s / buf.length);
}

function median(xs) {
  const s = [...xs].sort((a, b) => a - b);
  const m = s.length >> 1;
  return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
}

// The last turn's figures, the medians over all turns and the chart of the last ones.
function showLatency(stats) {
  const el = (id) => document.getElementById(id);
  const ms = (x) => `${Math.round(x)} ms`;
  const xs = stats.ttfaMs;
  const ys = stats.feltMs;
  const felt = ys.filter((y) => y != null);
  el("ttfa-last").textContent = xs.length ? ms(xs[xs.length - 1]) : "–";
  el("felt-last").textContent = ys.length && ys[ys.length - 1] != null ? ms(ys[ys.length - 1]) : "–";
  el("ttfa-count").textContent = String(xs.length);
  el("felt-median").textContent = felt.length ? ms(median(felt)) : "–";
  el("ttfa-median").textContent = xs.length ? ms(median(xs)) : "–";
  drawChart(el("ttfa-chart"), stats);
}

// The last turns: for each, speech end (mic) -> answer (dark) and speech_stopped -> answer (light), in ms.
function drawChart(c, stats) {
  const g = c.getContext("2d");
  const n = Math.min(CHART_TURNS, stats.ttfaMs.length);
  const felt = stats.feltMs.slice(-n);
  const shown = stats.ttfaMs.slice(-n);
  g.clearRect(0, 0, c.width, c.height);
  if (!n) return;
  const top = Math.max(500, ...shown, ...felt.filter((y) => y != null));
  const w = c.width / CHART_TURNS;
  const y = (ms) => c.height - 12 - (c.height - 14) * Math.min(1, ms / top);
  g.font = "10px sans-serif";
  g.fillStyle = "#888";
  g.textAlign = "right";
  g.fillText(`${Math.round(top)} ms`, c.width - 2, 10);
  for (let i = 0; i < n; i++) {
    if (felt[i] != null) {
      g.fillStyle = "#2f6fdb";
      g.fillRect(i * w + 2, y(felt[i]), w / 2 - 2, c.height - 12 - y(felt[i]));
    }
    g.fillStyle = "#9fbdf0";
    g.fillRect(i * w + w / 2, y(shown[i]), w / 2 - 2, c.height - 12 - y(shown[i]));
  }
}
