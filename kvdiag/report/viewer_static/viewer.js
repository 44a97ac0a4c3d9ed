// kvdiag token viewer: data from the JSON block above (kvdiag/viewer.py). A prompt's tokens are rendered once;
// a change of checkpoint, rule or amount only rewrites the class names that differ (paint), so a 4k-token prompt
// recolours in a few milliseconds.
(function () {
  "use strict";
  const D = JSON.parse(document.getElementById("kvdiag-data").textContent);
  const M = D.meta, NB = M.bins, EPS = 1e-9; // EPS: floor(rho * C) as in kvdiag.rankeval.metrics.n_evicted
  const $ = (id) => document.getElementById(id);
  const S = { p: 0, c: 0, rule: -1, mode: "rho", amount: M.rho, dr: true, bs: true, dec: 0 };
  let spans = [], cls = [], P = null, C = null;

  const fmt = (x) => (x === null || x === undefined ? "n/a" : Math.abs(x) >= 1e-3 && Math.abs(x) < 1e4 ? (+x.toPrecision(4)).toString() : x.toExponential(2));
  const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
  const bin = (kl) => kl <= 0 ? 0 : Math.max(0, Math.min(NB - 1, Math.floor((Math.log10(kl) - M.log_lo) / (M.log_hi - M.log_lo) * NB)));

  function option(sel, value, text) { const o = document.createElement("option"); o.value = value; o.textContent = text; sel.appendChild(o); }

  // how many of a rule's n scored candidates it evicts now
  function nEvict(n) {
    if (S.mode === "rho") return Math.max(0, Math.min(n, Math.floor(S.amount * n + EPS)));
    return Math.max(0, n - Math.floor(S.amount));
  }

  // eviction share of candidate j under rule k: 1 evicted, 0 kept, in between a tie group split at random
  function evicted(k, j, n) {
    const lo = C.lo[k][j];
    if (lo < 0) return 0;
    const sz = C.sz[k] ? C.sz[k][j] : 1;
    return Math.max(0, Math.min(1, (n - lo) / sz));
  }

  function renderPrompt() {
    P = D.prompts[S.p];
    const box = $("tokens"), frag = document.createDocumentFragment();
    spans = new Array(P.tokens.length); cls = new Array(P.tokens.length).fill("");
    for (let i = 0; i < P.tokens.length; i++) {
      const s = document.createElement("span");
      s.textContent = P.tokens[i].replace(/\n/g, "↵\n"); s.dataset.i = i; // ↵: a newline token gets a visible, hoverable box
      spans[i] = s; frag.appendChild(s);
    }
    box.replaceChildren(frag);
    const ck = $("ckpt"); ck.replaceChildren();
    P.ckpts.forEach((c, k) => option(ck, k, `t = ${c.t} (${c.pos.length} candidates)`));
    S.c = Math.min(S.c, P.ckpts.length - 1); ck.value = S.c;
  }

  function paint() {
    C = P.ckpts[S.c];
    const T = P.tokens.length, t = C.t, next = new Array(T);
    for (let i = 0; i < T; i++) next[i] = (i < P.plen ? "pr" : "") + (i >= t ? " fu" : "") + (S.dr && P.dr[i] ? " dr" : "");
    for (let j = 0; j < C.pos.length; j++) next[C.pos[j]] += C.st[j] === 2 ? " un" : " k" + bin(C.kl[j]);
    if (S.bs && P.bs[t]) for (const b of P.bs[t]) next[b[0]] += " bs";
    let summary = `checkpoint t = ${t}: ${C.pos.length} candidates, ${C.st.filter((s) => s === 1).length} harmful, ` +
      `${C.st.filter((s) => s === 2).length} unresolved (noise floor ${fmt(C.floor)})`;
    if (S.mode === "decision") {
      // a decision of kvdiag decisions: its evicted set at this checkpoint (share of the layers x KV heads evicting
      // each entry, 0..9) and the exact joint damage of the whole set
      const d = (C.dec || [])[S.dec];
      if (!d) summary += ` · <b>${esc(M.decisions[S.dec] || "")}</b>: no decision at this checkpoint`;
      else {
        let n = 0, miss = 0;
        for (let i = 0; i < Math.min(t, d[2].length); i++) {
          const f = +d[2][i];
          if (!f) continue;
          n += f / 9;
          next[i] += f === 9 ? " ev" : " ep";
        }
        for (let j = 0; j < C.pos.length; j++) if (+d[2][C.pos[j]] && C.st[j] === 1) { next[C.pos[j]] += " ms"; miss++; }
        summary += ` · <b>${esc(M.decisions[S.dec])}</b> evicts <span id="n-evicted">${Math.round(n)}</span> entries` +
          ` · joint damage <b><span id="joint-kl">${fmt(d[0])}</span></b> nats` +
          (d[1] === null ? "" : ` · sum of their single labels ${fmt(d[1])} (joint / sum ${d[1] > 0 ? fmt(d[0] / d[1]) : "n/a"})`) +
          ` · harmful labeled candidates evicted <span id="n-misses">${miss}</span>`;
      }
    } else if (S.rule >= 0) {
      const n = C.n[S.rule], e = nEvict(n);
      let miss = 0, part = false;
      for (let j = 0; j < C.pos.length; j++) {
        const f = evicted(S.rule, j, e);
        if (f <= 0) continue;
        next[C.pos[j]] += f < 1 ? " ep" : " ev";
        if (C.st[j] === 1) { next[C.pos[j]] += " ms"; miss += f; }
        if (f < 1) part = true;
      }
      const m = part ? miss.toFixed(2) : String(miss);
      summary += ` · <b>${esc(M.rules[S.rule])}</b> evicts <span id="n-evicted">${e}</span> of ${n} scored` +
        ` · misses (harmful evicted) <span id="n-misses">${m}</span>${part ? " (expected: a tie group straddles the boundary)" : ""}` +
        ` · false-safe rate ${e ? fmt(miss / e) : "n/a"}`;
    }
    for (let i = 0; i < T; i++) if (next[i] !== cls[i]) { spans[i].className = next[i]; cls[i] = next[i]; }
    $("summary").innerHTML = summary;
  }

  function tip(i) {
    const t = C.t, j = C.pos.indexOf(i);
    let h = `<b>position ${i}</b> ${esc(JSON.stringify(P.tokens[i]))} · ${i < P.plen ? "prompt" : "generated"}<br>`;
    if (j < 0) h += i >= t ? `not generated yet at checkpoint ${t}` : `not a labeled candidate at checkpoint ${t}`;
    else {
      const st = ["resolved", "<b>harmful</b>", "unresolved (≤ noise floor)"][C.st[j]];
      h += `checkpoint ${t} · age ${C.age[j]} · kl_mean <b>${fmt(C.kl[j])}</b> nats (${st}) · top-1 flips ${C.flips[j] < 0 ? "n/a" : C.flips[j]}`;
      if (M.rules.length) {
        h += `<div class="rules"><i>rule</i><i>pct</i><i>rule</i><i>pct</i>`;
        M.rules.forEach((r, k) => {
          const lo = C.lo[k][j], n = C.n[k], name = k === S.rule ? `<b>${esc(r)}</b>` : esc(r);
          if (lo < 0) { h += `<span>${name}</span><span>n/a</span>`; return; }
          const sz = C.sz[k] ? C.sz[k][j] : 1, pct = n > 1 ? 100 * (lo + (sz - 1) / 2) / (n - 1) : 50;
          const f = evicted(k, j, nEvict(n)), mark = f >= 1 ? ' <span class="x">✗</span>' : f > 0 ? ` <span class="x">✗ ${f.toFixed(2)}</span>` : "";
          h += `<span>${name}</span><span>${pct.toFixed(0)}${mark}</span>`;
        });
        h += `</div><small>pct: percentile rank of the rule's score among the checkpoint's scored candidates (0 = evicted ` +
          `first, 100 = kept last); ✗ = evicted now (a number: the chance, for a tie group split at the boundary)</small>`;
      }
    }
    const d = P.dr[i];
    if (d) h += `<br><span style="color:#1f6fd1">delayed read</span>: first strong read at query ${d[0]} (delay ${d[1]}); ` +
      `the window-only rule evicts it before the read: ${d[2] ? "yes" : "no"}`;
    const b = (P.bs[t] || []).find((x) => x[0] === i);
    if (b) h += `<br><span style="color:#8e2cc9">blind spot</span> at ${t}: low read pressure ${fmt(b[1])}, large value payload ${fmt(b[2])}`;
    return h;
  }

  function legend() {
    const ticks = [];
    for (let b = 0; b < NB; b++) ticks.push(`<span class="k${b}" title="kl_mean ≥ ${fmt(10 ** (M.log_lo + b * (M.log_hi - M.log_lo) / NB))}"></span>`);
    $("legend").innerHTML = `kl_mean ${fmt(10 ** M.log_lo)} <span class="ramp">${ticks.join("")}</span> ${fmt(10 ** M.log_hi)} nats (log) · ` +
      `harmful: &gt; ${fmt(M.threshold)} (${esc(M.harm)}) · <span class="sw un"></span> unresolved · <span class="sw" style="outline:1px solid #ccc">a</span> unlabeled · ` +
      `<span class="sw fu">a</span> after the checkpoint · <span class="sw ev">a</span> evicted · <span class="sw ev ms k9">a</span> miss · ` +
      `<span class="sw ep">a</span> tie, partly evicted · <span class="sw dr">a</span> delayed read · <span class="sw bs">a</span> blind spot`;
  }

  function init() {
    D.prompts.forEach((p, k) => option($("prompt"), k, `${p.id} (${p.tokens.length} tokens)`));
    option($("rule"), -1, "(none)");
    M.rules.forEach((r, k) => option($("rule"), k, r));
    $("amount").value = S.amount;
    if (M.decisions && M.decisions.length) {
      option($("mode"), "decision", "a decision (kvdiag decisions)");
      M.decisions.forEach((name, k) => option($("decision"), k, name));
      $("decision").onchange = (e) => { S.dec = +e.target.value; paint(); };
    } else $("decision").hidden = true;
    legend();
    $("notes").innerHTML = [`Harm threshold over ${M.n_evaluated} evaluated labels; unresolved: kl_mean ≤ ${M.noise_mult} × noise floor` +
      (M.include_unresolved ? " (included in the threshold)" : " (left out of the threshold)") +
      ". A rule evicts the floor(ρ·C) lowest-scored of the checkpoint's C scored candidates (ties split at random)."]
      .concat(M.notes).map(esc).join("<br>");
    $("prompt").onchange = (e) => { S.p = +e.target.value; S.c = 0; renderPrompt(); paint(); };
    $("ckpt").onchange = (e) => { S.c = +e.target.value; paint(); };
    $("rule").onchange = (e) => { S.rule = +e.target.value; paint(); };
    $("mode").onchange = (e) => {
      S.mode = e.target.value;
      $("amount").hidden = S.mode === "decision"; $("decision").hidden = S.mode !== "decision";
      if (S.mode === "decision") { paint(); return; }
      S.amount = S.mode === "rho" ? M.rho : Math.floor(C.n[Math.max(S.rule, 0)] / 2 || 0);
      $("amount").step = S.mode === "rho" ? 0.05 : 1; $("amount").value = S.amount; paint();
    };
    $("amount").oninput = (e) => { const v = parseFloat(e.target.value); if (Number.isFinite(v) && v >= 0) { S.amount = v; paint(); } };
    $("show-dr").onchange = (e) => { S.dr = e.target.checked; paint(); };
    $("show-bs").onchange = (e) => { S.bs = e.target.checked; paint(); };
    const box = $("tokens"), tipBox = $("tip");
    box.addEventListener("mouseover", (e) => {
      const i = e.target.dataset ? e.target.dataset.i : undefined;
      if (i === undefined) return;
      tipBox.innerHTML = tip(+i); tipBox.hidden = false;
      const r = e.target.getBoundingClientRect(), w = tipBox.offsetWidth, hgt = tipBox.offsetHeight;
      tipBox.style.left = Math.max(4, Math.min(r.left, innerWidth - w - 8)) + "px";
      tipBox.style.top = (r.bottom + hgt + 8 < innerHeight ? r.bottom + 4 : Math.max(4, r.top - hgt - 4)) + "px";
    });
    box.addEventListener("mouseout", () => { tipBox.hidden = true; });
    renderPrompt(); paint();
    document.body.dataset.ready = "1";
  }
  init();
})();
