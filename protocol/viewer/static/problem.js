// A problem page: for each arm, its text beside the full cache's with the first divergence marked,
// the per-step KL strip, the cache map, the answers, the gold and the grader's rule.
"use strict";

const RVProblem = (() => {
  const {esc, num, pct, budget} = RV;

  // [start, end) of token `i` in `text` (UTF-16 offsets): exact with the tokenizer's lengths, else
  // from `fallback` (the first character where the two texts differ) to the end of its word.
  function tokenSpan(rec, i, fallback) {
    if (rec.tokens && i != null) {
      let start = rec.tokens.o;
      for (let k = 0; k < Math.min(i, rec.tokens.lens.length); k++) start += rec.tokens.lens[k];
      const len = i < rec.tokens.lens.length ? rec.tokens.lens[i] : 0;
      return [start, start + len, true];
    }
    const start = Math.min(fallback, rec.text.length);
    const rest = rec.text.slice(start).search(/\s/);
    return [start, rest < 0 ? rec.text.length : start + Math.max(rest, 1), false];
  }

  // The text with the divergence marked: shared prefix plain, the first differing token in a
  // <mark class="divmark">, the rest tinted.
  function textBlock(rec, token, charAt, title) {
    const pre = document.createElement("pre");
    pre.className = "text";
    if (token == null) {
      pre.textContent = rec.text;
      return pre;
    }
    const [start, end, exact] = tokenSpan(rec, token, charAt);
    pre.append(document.createTextNode(rec.text.slice(0, start)));
    const mark = document.createElement("mark");
    mark.className = "divmark";
    mark.dataset.token = token;
    mark.dataset.exact = exact ? "1" : "0";
    mark.title = title + (exact ? "" : " (no tokenizer: marked where the texts first differ)");
    mark.textContent = rec.text.slice(start, end) || "⏹";
    pre.append(mark);
    const after = document.createElement("span");
    after.className = "after";
    after.textContent = rec.text.slice(end);
    pre.append(after);
    return pre;
  }

  // Why a traced run's record has no cache map: its trace line is missing, or the file was cut short.
  function traceGap(rec) {
    return rec.trace === "truncated"
      ? "trace truncated: this run's trace.jsonl ends in a half-written line and this record's trace is lost"
      : "trace missing: this run was traced, but trace.jsonl has no line for this record";
  }

  function column(head, pre) {
    const div = document.createElement("div");
    div.className = "col";
    div.innerHTML = `<h4>${head}</h4>`;
    div.append(pre);
    return div;
  }

  // The per-step KL(full || retained) strip: one column per output token (step 0 = prefill logits),
  // darker = larger; ticks below where the top-1 token differs from the full cache's.
  function klStrip(rec, info, divToken) {
    const wrap = document.createElement("div");
    wrap.className = "klwrap";
    if (!rec.kl) {
      wrap.innerHTML = `<p class="absent kl-absent">${rec.trace === "ok" ? "no per-step KL: the run had no --fidelity"
        : rec.trace === "none" ? "no per-step KL: no trace (run with --trace --fidelity)"
        : "no per-step KL: " + traceGap(rec)}</p>`;
      return wrap;
    }
    const canvas = document.createElement("canvas");
    canvas.className = "kl";
    const steps = rec.kl.length, vals = rec.kl.filter((v) => v != null);
    const max = vals.length ? Math.max(...vals) : 0;
    const mean = vals.length ? vals.reduce((a, b) => a + b, 0) / vals.length : null;
    const width = Math.max(1, Math.min(steps, 1200));
    canvas.width = width;
    canvas.height = 30;
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, width, 30);
    for (let x = 0; x < width; x++) {
      const lo = Math.floor(x * steps / width), hi = Math.max(lo + 1, Math.floor((x + 1) * steps / width));
      let v = 0, disagree = false;
      for (let s = lo; s < hi; s++) {
        v = Math.max(v, rec.kl[s] || 0);
        if (rec.top1 && rec.top1[s] === "0") disagree = true;
      }
      const t = max > 0 ? Math.log1p(v) / Math.log1p(max) : 0;
      ctx.fillStyle = `rgb(${255 - Math.round(70 * t)},${255 - Math.round(228 * t)},${255 - Math.round(228 * t)})`;
      ctx.fillRect(x, 0, 1, 22);
      if (disagree) { ctx.fillStyle = "#111"; ctx.fillRect(x, 24, 1, 6); }
    }
    if (divToken != null && divToken >= 0 && divToken < steps) {
      ctx.fillStyle = "rgb(37,99,235)";
      ctx.fillRect(Math.floor(divToken * width / steps), 0, Math.max(1, Math.ceil(width / steps)), 30);
    }
    Object.assign(canvas.dataset, {steps, klMean: mean == null ? "" : String(mean), klMax: String(max),
                                   top1Disagree: rec.top1 ? String((rec.top1.match(/0/g) || []).length) : ""});
    const caption = document.createElement("p");
    caption.className = "caption";
    const first = rec.fidelity && rec.fidelity.first_divergence_step;
    caption.textContent = `KL(full ‖ retained) per step, ${steps} steps, max ${max.toPrecision(3)}; ticks: top-1 differs`
      + (first != null ? ` (first at step ${first})` : "") + (divToken != null && divToken >= 0 ? `; blue: token ${divToken},`
      + " where the text leaves the full cache's" : "");
    canvas.addEventListener("mousemove", (ev) => {
      const s = Math.min(steps - 1, Math.floor(ev.offsetX / canvas.clientWidth * steps));
      const piece = rec.tokens ? ` token ${JSON.stringify(rec.text.slice(...tokenSpan(rec, s, 0).slice(0, 2)))}` : "";
      info.textContent = `step ${s}: KL ${rec.kl[s] == null ? "–" : rec.kl[s]}`
        + (rec.top1 ? `, top-1 ${rec.top1[s] === "1" ? "agrees" : "differs"}` : "") + piece;
    });
    wrap.append(canvas, caption);
    return wrap;
  }

  function cacheMap(rec) {
    const wrap = document.createElement("div");
    wrap.className = "mapwrap";
    if (rec.trace !== "ok") {
      wrap.innerHTML = rec.trace === "none" ? `<p class="absent map-absent">no trace: this record's run was written `
        + "without --trace (run with --trace to see what the cache held)</p>"
        : `<p class="absent map-absent trace-${esc(rec.trace)}">${traceGap(rec)}</p>`;
      return wrap;
    }
    const m = rec.map, r = RVMap.reconstruct(m);
    const canvas = document.createElement("canvas"), line = document.createElement("canvas");
    canvas.className = "cachemap";
    line.className = "prompt-line";
    RVMap.draw(canvas, line, m, r);
    RVMap.describe(canvas, m, r);
    const row = document.createElement("div");
    row.className = "maprow";
    row.append(canvas, line);
    const legend = document.createElement("p");
    legend.className = "caption";
    legend.innerHTML = `Cache: positions → (0..${m.n - 1}; prompt 0..${m.P - 1}), decode steps ↓ (${m.steps}); `
      + `<span class="sw prompt"></span> prompt held <span class="sw gen"></span> generated held `
      + `<span class="sw ev"></span> evicted <span class="sw merged"></span> merged <span class="sw quant"></span> quantised; `
      + `paler = held by fewer of the ${m.pairs} (group, head) pairs. Right: share of the prompt held `
      + `(final ${r.promptHeldFinal == null ? "100% (never compacted)" : (100 * r.promptHeldFinal).toFixed(1) + "%"}${r.promptEvictedStep == null ? ", never evicted"
        : `, first evicted at step ${r.promptEvictedStep}`}). ${m.c.length} compaction(s); mean stored `
      + `${r.mean == null ? "–" : r.mean.toFixed(2)} tokens per (layer, head) over the decode steps.`;
    const list = document.createElement("details");
    list.innerHTML = `<summary>compactions</summary><table class="comps"><tr><th>step</th><th>before</th>`
      + `<th>kept (mean)</th><th>kept min–max</th><th>prompt held</th><th>allocation</th></tr>`
      + r.comps.map((c) => `<tr><td>${esc(c.s)}</td><td>${esc(c.raw.b)}</td><td>${num(c.kept)}</td>`
        + `<td>${Math.min(...c.raw.k)}–${Math.max(...c.raw.k)}</td><td>${(100 * c.prompt).toFixed(1)}%</td>`
        + `<td>${c.raw.a ? esc(c.raw.a.join(" ")) : "–"}</td></tr>`).join("") + "</table>";
    wrap.append(row, legend, list);
    return wrap;
  }

  function answers(rec, gold) {
    const fid = rec.fidelity;
    const verdict = rec.verdict === true ? "correct" : rec.verdict === false ? "wrong" : "ungradable";
    return `<dl class="answers"><dt>answer</dt><dd><code>${esc(rec.extracted)}</code> <span class="v ${verdict}">${verdict}</span></dd>`
      + `<dt>gold</dt><dd><code>${esc(gold)}</code></dd><dt>rule</dt><dd>${esc(rec.rule || "–")}${rec.reason ? ` (${esc(rec.reason)})` : ""}</dd>`
      + `<dt>output</dt><dd>${esc(rec.n_tokens)} tokens, ${esc(rec.finish_reason)}</dd>`
      + `<dt>cache</dt><dd>mean ${num(rec.cache_mean_tokens)} tokens, ${esc(rec.compactions ?? "–")} compactions</dd>`
      + (fid ? `<dt>fidelity</dt><dd>KL mean ${num(fid.kl_mean, 4)}, top-1 agreement ${pct(fid.top1_agreement)}%, `
        + (fid.first_divergence_step == null ? "the top-1 token never differs"
          : `first top-1 difference at step ${esc(fid.first_divergence_step)}`) + "</dd>" : "")
      + (rec.div ? `<dt>vs full</dt><dd>answer ${rec.div.changed ? "<b>changed</b>" : "same"}; `
        + (rec.div.token == null ? "identical tokens" : `tokens differ from #${esc(rec.div.token)}`) + "</dd>" : "")
      + "</dl>";
  }

  function armSection(key, data) {
    const a = RV.arm(key), rec = data.arms[key];
    const sec = document.createElement("section");
    sec.className = "arm";
    sec.id = `arm-${key}`;
    sec.dataset.arm = key;
    sec.innerHTML = `<h3>${esc(a.label)} <small>${esc(a.model)}, budget ${budget(a.budget)}, ${esc(a.accounting)}</small></h3>`
      + answers(rec, data.gold);
    const cols = document.createElement("div");
    cols.className = "cols";
    const ref = a.ref ? data.arms[a.ref] : null;
    const tok = rec.div ? rec.div.token : null;
    const title = `first output token differing from the full cache's (#${tok})`;
    cols.append(column(`${esc(a.label)}${rec.tokens ? "" : " <small>(no tokenizer: token boundaries approximate)</small>"}`,
                       textBlock(rec, tok, rec.div ? rec.div.char : 0, title)));
    if (ref) cols.append(column(`full cache: ${esc(RV.arm(a.ref).label)}`, textBlock(ref, tok, rec.div.char, title)));
    else cols.append(Object.assign(document.createElement("p"), {className: "absent",
      textContent: a.budget == null ? "this run is a full-cache reference" : "no full-cache run among the inputs"}));
    const info = document.createElement("p");
    info.className = "hover";
    sec.append(cols, klStrip(rec, info, tok), info, cacheMap(rec));
    return sec;
  }

  async function show(i, armKey) {
    const app = document.getElementById("app");
    const back = `#/?${RV.queryString(RV.state.query)}`;
    const prev = RV.neighbour(i, -1), next = RV.neighbour(i, 1);
    let data;
    try {
      data = await RV.load(i);
    } catch (err) {
      app.innerHTML = `<p class="error">${esc(err.message)}</p>`;
      return;
    }
    if (!location.hash.startsWith(`#/p/${i}`)) return;  // navigated away while loading
    const nav = `<nav><a href="${back}" id="back">← list</a>`
      + (prev != null ? ` <a href="#/p/${prev}" id="prev">← previous</a>` : "")
      + (next != null ? ` <a href="#/p/${next}" id="next">next →</a>` : "") + "</nav>";
    app.innerHTML = `${nav}<h2 id="problem" data-i="${esc(i)}">${esc(data.pid)} <small>sample ${esc(data.sample)}</small></h2>`
      + (data.statement ? `<details open><summary>problem</summary><pre class="statement">${esc(data.statement)}</pre></details>` : "");
    RV.state.index.arms.filter((a) => data.arms[a.key]).forEach((a) => app.append(armSection(a.key, data)));
    // Scroll each text box to its divergence marker (the shared prefix stays above it).
    app.querySelectorAll("pre.text").forEach((pre) => {
      const mark = pre.querySelector("mark.divmark");
      if (mark) pre.scrollTop = Math.max(0, mark.offsetTop - pre.offsetTop - 60);
    });
    const target = armKey && document.getElementById(`arm-${armKey}`);
    if (target) target.scrollIntoView(); else window.scrollTo(0, 0);
  }

  return {show};
})();
