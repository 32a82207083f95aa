// The cache of one record as a position x step map, rebuilt from its trace's compactions
// (protocol/viewer/cachemap.py writes the data; trace schema v1 in docs/records.md).
//
// At decode step d (feeding output token d, at position P + d), after the last compaction c with
// c.s <= d, each (group, head) pair holds its kept set plus positions P + c.s .. P + d (generated
// since); before the first compaction it holds every position up to P + d. `stored[d]` is the most
// any pair holds (the meter's count per (layer, head); equal for every pair unless a routing gives
// heads different budgets): averaged over the decode steps it is the record's cache_mean_tokens.
"use strict";

const RVMap = (() => {
  const PROMPT = [37, 99, 235], GENERATED = [234, 88, 12], EVICTED = [226, 226, 226];
  const MERGED = [22, 163, 74], QUANTISED = [147, 51, 234], FUTURE = [255, 255, 255];

  // {p: delta-encoded positions, c: counts | absent (all = pairs)} -> per-position share (n,) of pairs
  function shares(sp, n, pairs) {
    const out = new Float32Array(n);
    if (!sp) return out;
    let at = 0;
    sp.p.forEach((delta, i) => { at += delta; out[at] = (sp.c ? sp.c[i] : pairs) / pairs; });
    return out;
  }

  function reconstruct(m) {
    const {P, n, pairs, steps} = m;
    const comps = m.c.map((c) => {
      const held = shares(c.held, n, pairs);
      let prompt = 0;
      for (let p = 0; p < Math.min(P, n); p++) prompt += held[p];
      return {s: c.s, kept: Math.max(...c.k), held, prompt: P ? prompt / P : 0,
              merged: c.m ? shares(c.m, n, pairs) : null, quant: c.q ? shares(c.q, n, pairs) : null, raw: c};
    });
    const stored = new Float64Array(steps), prompt = new Float64Array(steps), which = new Int32Array(steps);
    let ci = -1;
    for (let d = 0; d < steps; d++) {
      while (ci + 1 < comps.length && comps[ci + 1].s <= d) ci++;
      which[d] = ci;
      stored[d] = ci < 0 ? m.prefill + d + 1 : comps[ci].kept + (d - comps[ci].s + 1);
      prompt[d] = ci < 0 ? 1 : comps[ci].prompt;
    }
    const evicted = comps.find((c) => c.prompt < 1 - 1e-12);
    return {comps, stored, prompt, which,
            mean: steps ? stored.reduce((a, b) => a + b, 0) / steps : null,
            promptHeldFinal: comps.length && P ? comps[comps.length - 1].prompt : null,
            promptEvictedStep: evicted ? evicted.s : null};
  }

  const mix = (a, b, t) => [0, 1, 2].map((k) => Math.round(a[k] * (1 - t) + b[k] * t));

  // The map: x = positions (prompt first), y = decode steps (down). Each pixel averages its bin.
  function draw(canvas, line, m, r) {
    const cols = Math.max(1, Math.min(m.n, 900)), rows = Math.max(1, Math.min(m.steps, 480));
    canvas.width = cols;
    canvas.height = rows;
    const ctx = canvas.getContext("2d");
    const img = ctx.createImageData(cols, rows);
    for (let y = 0; y < rows; y++) {
      const d = Math.floor(y * m.steps / rows);
      const c = r.which[d] >= 0 ? r.comps[r.which[d]] : null;
      for (let x = 0; x < cols; x++) {
        const lo = Math.floor(x * m.n / cols), hi = Math.max(lo + 1, Math.floor((x + 1) * m.n / cols));
        let exist = 0, held = 0, merged = 0, quant = 0;
        for (let p = lo; p < hi; p++) {
          if (p > m.P + d) continue;  // not generated yet
          exist++;
          if (!c || p >= m.P + c.s) { held += 1; continue; }
          held += c.held[p];
          if (c.merged) merged += c.merged[p];
          if (c.quant) quant += c.quant[p];
        }
        let rgb = FUTURE;
        if (exist) {
          rgb = mix(EVICTED, lo < m.P ? PROMPT : GENERATED, held / exist);
          if (merged) rgb = mix(rgb, MERGED, merged / exist);
          if (quant) rgb = mix(rgb, QUANTISED, quant / exist);
        }
        const o = 4 * (y * cols + x);
        img.data[o] = rgb[0]; img.data[o + 1] = rgb[1]; img.data[o + 2] = rgb[2]; img.data[o + 3] = 255;
      }
    }
    ctx.putImageData(img, 0, 0);
    // The share of the prompt still held at each step, on the same vertical axis (drawn at its CSS
    // size, 90 x 320, so that the line stays sharp however few steps there are).
    const W = 90, H = 320;
    line.width = W;
    line.height = H;
    const lc = line.getContext("2d");
    lc.fillStyle = "#f8fafc";
    lc.fillRect(0, 0, W, H);
    lc.strokeStyle = "#cbd5e1";
    lc.strokeRect(0.5, 0.5, W - 1, H - 1);
    lc.fillStyle = "#64748b";
    lc.font = "10px sans-serif";
    lc.fillText("0", 3, H - 4);
    lc.fillText("100%", W - 28, H - 4);
    lc.strokeStyle = "rgb(37,99,235)";
    lc.lineWidth = 2;
    lc.beginPath();
    for (let y = 0; y < H; y++) {
      const d = Math.min(m.steps - 1, Math.floor(y * m.steps / H)), px = 3 + (m.steps ? r.prompt[d] : 1) * (W - 6);
      if (y === 0) lc.moveTo(px, y); else lc.lineTo(px, y);
    }
    lc.stroke();
  }

  // Attributes the browser test reads: the map's own figures, to compare with the record's.
  function describe(canvas, m, r) {
    const ds = canvas.dataset;
    ds.steps = m.steps;
    ds.positions = m.n;
    ds.promptTokens = m.P;
    ds.compactions = m.c.length;
    ds.storedMean = r.mean == null ? "" : String(r.mean);
    ds.storedFinal = m.steps ? String(r.stored[m.steps - 1]) : "";
    ds.promptHeldFinal = r.promptHeldFinal == null ? "" : String(r.promptHeldFinal);
    ds.promptEvictedStep = r.promptEvictedStep == null ? "" : String(r.promptEvictedStep);
    canvas.rvStored = Array.from(r.stored);
    canvas.rvPrompt = Array.from(r.prompt);
  }

  return {reconstruct, draw, describe, shares};
})();
