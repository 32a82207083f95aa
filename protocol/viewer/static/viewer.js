// retention viewer: the index (arms, comparisons, the filtered problem list), routing, keyboard.
// Data arrive as script files: data/index.js calls RV.index(...), data/r/<i>.js calls RV.record(i, ...)
// (file:// pages cannot fetch() local JSON). problem.js draws a problem page, cachemap.js its cache map.
"use strict";

const RV = (() => {
  const state = {index: null, rows: [], sel: 0, query: {}, records: {}, waiting: {}};

  const esc = (s) => String(s == null ? "" : s).replace(/[&<>"']/g,
    (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
  const num = (x, d = 1) => (x == null || Number.isNaN(x) ? "–" : Number(x).toFixed(d));
  const pct = (x, d = 1) => (x == null ? "–" : (100 * x).toFixed(d));
  const pval = (p) => (p == null ? "–" : p >= 0.001 ? Number(p).toPrecision(2) : Number(p).toExponential(1));
  const budget = (b) => (b == null ? "full" : esc(b));
  const arm = (key) => state.index.arms.find((a) => a.key === key);
  const armIndex = (key) => state.index.arms.findIndex((a) => a.key === key);

  // ---------------------------------------------------------------------------------- data loading
  function index(data) {
    state.index = data;
    route();
  }

  function record(i, data) {
    state.records[i] = data;
    (state.waiting[i] || []).forEach((w) => w.resolve(data));
    delete state.waiting[i];
  }

  // Per-problem data: a <script> tag per file, loaded once, only when the problem is opened.
  function load(i) {
    if (state.records[i]) return Promise.resolve(state.records[i]);
    return new Promise((resolve, reject) => {
      const first = !state.waiting[i];
      (state.waiting[i] = state.waiting[i] || []).push({resolve, reject});
      if (!first) return;
      const tag = document.createElement("script");
      tag.src = `data/r/${i}.js`;
      tag.onerror = () => {
        (state.waiting[i] || []).forEach((w) => w.reject(new Error(`cannot load data/r/${i}.js`)));
        delete state.waiting[i];
      };
      document.body.appendChild(tag);
    });
  }

  // ---------------------------------------------------------------------------------- routing
  // #/?arm=a0&v=wrong&ch=1&vs=a1&q=text   the list;   #/p/<i>[/<arm key>]   a problem page
  function parseQuery(text) {
    const q = {};
    new URLSearchParams(text || "").forEach((v, k) => { if (v !== "") q[k] = v; });
    return q;
  }
  const queryString = (q) => new URLSearchParams(Object.entries(q).filter(([, v]) => v != null && v !== "")).toString();

  function route() {
    if (!state.index) return;
    const hash = location.hash.replace(/^#\/?/, "");
    const m = hash.match(/^p\/(\d+)(?:\/([\w-]+))?/);
    if (m) {
      RVProblem.show(Number(m[1]), m[2] || null);
    } else {
      state.query = parseQuery(hash.replace(/^\?/, ""));
      showList();
    }
  }

  // ---------------------------------------------------------------------------------- filters
  function defaultArm() {
    const arms = state.index.arms;
    return (arms.find((a) => a.ref) || arms[0]).key;
  }

  // Rows of the problem table that pass the filters (each row: [i, problem_id, sample, cells per arm]).
  function filtered(q = state.query) {
    const a = armIndex(q.arm || defaultArm());
    const vs = q.vs ? armIndex(q.vs) : -1;
    return state.index.problems.filter((row) => {
      const cell = row[3][a];
      if (!cell) return false;
      if (q.v === "correct" && cell[0] !== 1) return false;
      if (q.v === "wrong" && cell[0] === 1) return false;
      if (q.v === "ungradable" && cell[0] !== null) return false;
      if (q.ch === "1" && cell[1] !== 1) return false;
      if (q.ch === "0" && cell[1] !== 0) return false;
      if (vs >= 0 && (!row[3][vs] || (row[3][vs][0] === 1) === (cell[0] === 1))) return false;
      if (q.q && !row[1].toLowerCase().includes(q.q.toLowerCase())) return false;
      return true;
    });
  }

  function setQuery(q) {
    location.hash = "#/?" + queryString(q);
  }

  // ---------------------------------------------------------------------------------- the list page
  function comparisonsTable() {
    const rows = state.index.comparisons;
    if (!rows.length) return "";
    const body = rows.map((r) => {
      const fid = (r.fidelity || []).map((f) => `${esc(f.metric)} ${Number(f.mean_treatment).toPrecision(4)} vs `
        + `${Number(f.mean_baseline).toPrecision(4)}, Δ ${Number(f.estimate).toPrecision(3)} `
        + `[${Number(f.ci95_lo).toPrecision(3)}, ${Number(f.ci95_hi).toPrecision(3)}], p ${pval(f.p_bootstrap)}`).join("; ");
      const link = `#/?${queryString({arm: r.t, vs: r.b})}`;
      return `<tr class="cmp" data-t="${esc(r.t)}" data-b="${esc(r.b)}"><td>${esc(r.model)}</td><td>${budget(r.budget)}</td>`
        + `<td><a href="${link}" title="problems where the two arms' verdicts differ">${esc(r.treatment)} vs ${esc(r.baseline)}</a></td>`
        + `<td>${esc(r.accounting)}</td><td>${pct(r.acc_treatment)}</td><td>${pct(r.acc_baseline)}</td>`
        + `<td>${num(r.delta_pp, 2)}</td><td>[${num(r.ci95_lo_pp)}, ${num(r.ci95_hi_pp)}]</td>`
        + `<td>${pval(r.p_bootstrap)}</td><td>${pval(r.p_bonferroni)}</td><td class="verdict">${esc(r.verdict)}</td>`
        + `<td>${esc(r.n)}</td><td>${esc(r.k)}</td></tr>` + (fid ? `<tr class="fid"><td></td><td colspan="12">fidelity `
        + `(exploratory): ${fid}</td></tr>` : "");
    }).join("");
    return `<h2>Comparisons</h2><table class="report" id="comparisons"><thead><tr><th>model</th><th>budget</th>`
      + `<th>treatment vs baseline</th><th>acct</th><th>acc T %</th><th>acc B %</th><th>Δ pp</th><th>95% CI</th>`
      + `<th>p</th><th>p_bonf</th><th>verdict</th><th>n</th><th>k</th></tr></thead><tbody>${body}</tbody></table>`
      + state.index.tests.map((t) => `<p class="note">${esc(t)}</p>`).join("");
  }

  function armsTable() {
    const body = state.index.arms.map((a) => `<tr class="armrow" data-arm="${esc(a.key)}">`
      + `<td><a href="#/?${queryString({arm: a.key})}">${esc(a.label)}</a></td><td>${esc(a.model)}</td>`
      + `<td>${budget(a.budget)}</td><td>${esc(a.accounting)}</td><td>${esc(a.n_records)}</td>`
      + `<td>${pct(a.accuracy)} [${pct(a.acc_ci95_lo)}, ${pct(a.acc_ci95_hi)}]</td><td>${num(a.cache_mean_tokens)}</td>`
      + `<td>${num(a.mean_output_tokens, 0)}</td><td>${pct(a.truncation_rate, 0)}</td><td>${num(a.kl_mean, 4)}</td>`
      + `<td>${pct(a.top1_agreement)}</td><td>${num(a.first_divergence_median, 0)}</td>`
      + `<td>${a.traced ? "yes" : "no"}</td><td>${a.ref ? esc(arm(a.ref).label) : "–"}</td></tr>`).join("");
    return `<h2>Arms</h2><table class="report" id="arms"><thead><tr><th>arm</th><th>model</th><th>budget</th>`
      + `<th>acct</th><th>records</th><th>acc % [95% CI]</th><th>mean cache</th><th>out len</th><th>trunc %</th>`
      + `<th>KL mean</th><th>top-1 %</th><th>1st div</th><th>trace</th><th>full reference</th></tr></thead>`
      + `<tbody>${body}</tbody></table>`;
  }

  function filterForm(q) {
    const arms = state.index.arms;
    const opt = (value, text, cur) => `<option value="${esc(value)}"${cur === value ? " selected" : ""}>${esc(text)}</option>`;
    const a = q.arm || defaultArm();
    const hasRef = !!arm(a).ref;
    return `<form id="filters">`
      + `<label>arm <select id="f-arm">${arms.map((x) => opt(x.key, `${x.label} (${x.model}, ${budget(x.budget)})`, a)).join("")}</select></label>`
      + `<label>verdict <select id="f-v">${opt("", "any", q.v || "")}${opt("correct", "correct", q.v)}${opt("wrong", "wrong", q.v)}`
      + `${opt("ungradable", "ungradable", q.v)}</select></label>`
      + `<label>answer vs full <select id="f-ch"${hasRef ? "" : " disabled"}>${opt("", "any", q.ch || "")}${opt("1", "changed", q.ch)}`
      + `${opt("0", "same", q.ch)}</select></label>`
      + `<label>verdict differs from <select id="f-vs">${opt("", "–", q.vs || "")}`
      + `${arms.filter((x) => x.key !== a).map((x) => opt(x.key, x.label, q.vs)).join("")}</select></label>`
      + `<label>problem <input id="f-q" type="search" value="${esc(q.q || "")}" placeholder="id contains"></label></form>`;
  }

  function problemTable(rows, q) {
    const arms = state.index.arms;
    const a = armIndex(q.arm || defaultArm());
    const mark = (cell, ref) => {
      if (!cell) return `<td class="na">·</td>`;
      const v = cell[0] === 1 ? ["ok", "✓"] : cell[0] === 0 ? ["bad", "✗"] : ["unk", "?"];
      const changed = cell[1] === 1 ? `<span class="changed" title="answer differs from the full cache">Δ</span>` : "";
      const div = cell[2] == null || !ref ? "" : cell[2] < 0 ? `<span class="div">=</span>`
        : `<span class="div" title="first token differing from the full cache">@${cell[2]}</span>`;
      return `<td class="${v[0]}">${v[1]}${changed}${div}</td>`;
    };
    const body = rows.map((row, n) => `<tr data-i="${esc(row[0])}" class="prow${n === state.sel ? " sel" : ""}">`
      + `<td>${esc(row[0])}</td><td><a href="#/p/${encodeURIComponent(row[0])}/${encodeURIComponent(arms[a].key)}">`
      + `${esc(row[1])}</a></td><td>${esc(row[2])}</td>`
      + arms.map((x, j) => mark(row[3][j], x.ref)).join("") + "</tr>").join("");
    return `<table id="problems"><thead><tr><th>#</th><th>problem</th><th>sample</th>`
      + arms.map((x, j) => `<th class="${j === a ? "cur" : ""}">${esc(x.label)}<br><small>${esc(x.model)} ${budget(x.budget)}</small></th>`).join("")
      + `</tr></thead><tbody>${body}</tbody></table>`;
  }

  function showList() {
    const q = state.query;
    const rows = filtered(q);
    state.rows = rows;
    state.sel = Math.min(state.sel, Math.max(rows.length - 1, 0));
    const ix = state.index;
    const figures = ix.figures.map((f) => `<a href="figures/${esc(f)}"><img src="figures/${esc(f)}" alt="${esc(f)}"></a>`).join("");
    document.title = ix.title;
    document.getElementById("app").innerHTML = comparisonsTable() + armsTable()
      + (figures ? `<h2>Figures</h2><div class="figures">${figures}</div>` : "")
      + ix.notes.map((n) => `<p class="note">note: ${esc(n)}</p>`).join("")
      + `<h2>Problems</h2>${filterForm(q)}<p id="count" data-count="${rows.length}">${rows.length} of `
      + `${ix.problems.length} (problem, sample) rows</p>${problemTable(rows, q)}`;
    const onChange = () => {
      const val = (id) => document.getElementById(id).value;
      const next = {arm: val("f-arm"), v: val("f-v"), ch: val("f-ch"), vs: val("f-vs"), q: val("f-q")};
      if (next.vs === next.arm) next.vs = "";
      if (!arm(next.arm).ref) next.ch = "";
      state.sel = 0;
      setQuery(next);
    };
    ["f-arm", "f-v", "f-ch", "f-vs"].forEach((id) => document.getElementById(id).addEventListener("change", onChange));
    document.getElementById("f-q").addEventListener("change", onChange);
    document.getElementById("filters").addEventListener("submit", (ev) => { ev.preventDefault(); onChange(); });
    document.querySelectorAll("#problems tbody tr").forEach((tr, n) => tr.addEventListener("click", (ev) => {
      if (ev.target.tagName === "A") return;
      state.sel = n;
      open();
    }));
  }

  function moveSelection(delta) {
    if (!state.rows.length) return;
    state.sel = Math.max(0, Math.min(state.rows.length - 1, state.sel + delta));
    const trs = document.querySelectorAll("#problems tbody tr");
    trs.forEach((tr, n) => tr.classList.toggle("sel", n === state.sel));
    if (trs[state.sel]) trs[state.sel].scrollIntoView({block: "nearest"});
  }

  function open() {
    const row = state.rows[state.sel];
    if (row) location.hash = `#/p/${row[0]}/${state.query.arm || defaultArm()}`;
  }

  // The problem before / after `i` in the filtered list (for n/p on a problem page).
  function neighbour(i, delta) {
    const rows = filtered();
    const at = rows.findIndex((r) => r[0] === i);
    const row = rows[at + delta];
    return row ? row[0] : null;
  }

  function onKey(ev) {
    if (!state.index || ev.ctrlKey || ev.metaKey || ev.altKey) return;
    if (/^(INPUT|SELECT|TEXTAREA)$/.test(document.activeElement && document.activeElement.tagName)) return;
    const onList = !/^#\/?p\//.test(location.hash);
    if (onList) {
      if (ev.key === "j" || ev.key === "ArrowDown") { moveSelection(1); ev.preventDefault(); }
      else if (ev.key === "k" || ev.key === "ArrowUp") { moveSelection(-1); ev.preventDefault(); }
      else if (ev.key === "Enter") { open(); ev.preventDefault(); }
      return;
    }
    const i = Number(location.hash.match(/^#\/?p\/(\d+)/)[1]);
    if (ev.key === "Escape" || ev.key === "u" || ev.key === "Backspace") { setQuery(state.query); ev.preventDefault(); }
    else if (["n", "j", "ArrowRight", "p", "k", "ArrowLeft"].includes(ev.key)) {
      const next = neighbour(i, ["n", "j", "ArrowRight"].includes(ev.key) ? 1 : -1);
      if (next != null) {
        state.sel = filtered().findIndex((r) => r[0] === next);
        location.hash = `#/p/${next}/${state.query.arm || defaultArm()}`;
      }
      ev.preventDefault();
    }
  }

  window.addEventListener("hashchange", route);
  window.addEventListener("keydown", onKey);
  return {index, record, load, route, state, esc, num, pct, pval, budget, arm, neighbour, queryString, defaultArm};
})();
