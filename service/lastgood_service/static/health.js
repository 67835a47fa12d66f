// The selected run's health (GET /api/v1/runs/{run}/health): verdicts per rank and the
// checkpoint interval with the run's own numbers. docs/health.md explains both.

import { formatNumber, h } from './dom.js';

const MAX_RANKS_SHOWN = 32; // the unhealthy ranks first, then this many in all

/** 3.2 s, 14 min, 2.5 h, 3.1 d. */
export function duration(s) {
  if (s === null || s === undefined) return '–';
  const steps = [[120, 's', 1], [7200, 'min', 60], [3 * 86400, 'h', 3600]];
  for (const [limit, unit, div] of steps) {
    if (s < limit) return `${(s / div).toFixed(s / div < 10 ? 1 : 0)} ${unit}`;
  }
  return `${(s / 86400).toFixed(1)} d`;
}

/** The run's recent failures, the same count as the runs list's badge (docs/health.md). */
function failures(doc) {
  const f = doc.failures;
  if (!f || !f.count) return [];
  const kinds = Object.entries(f.kinds).sort().map(([k, n]) => `${k.replace(/_/g, ' ')} ${n}`).join(', ');
  return [h('span', { class: 'badge bad', dataset: { failures: String(f.count) }, title: f.last_at ? `last ${f.last_at}` : null },
    `${formatNumber(f.count)} failure${f.count === 1 ? '' : 's'} (${duration(f.window_s)}): ${kinds}`)];
}

function verdicts(doc) {
  if (!doc.ranks.length) return [h('span', { class: 'badge' }, 'no heartbeats yet'), ...failures(doc)];
  if (doc.finished) {
    return [h('span', { class: 'badge done', dataset: { verdict: 'finished' }, title: doc.finished_at },
      `finished: ${doc.ranks.length === 1 ? 'its rank closed its Checkpointer'
        : `${formatNumber(doc.ranks.length)} ranks closed their Checkpointers`}`), ...failures(doc)];
  }
  const out = [];
  const list = (ranks) => ranks.slice(0, 12).join(', ') + (ranks.length > 12 ? ', …' : '');
  if (doc.hung.length) out.push(h('span', { class: 'badge bad', dataset: { verdict: 'hung' } }, `hung: rank ${list(doc.hung)}`));
  if ((doc.lost || []).length) out.push(h('span', { class: 'badge bad', dataset: { verdict: 'lost' } }, `lost: rank ${list(doc.lost)}`));
  if (doc.stragglers.length) {
    out.push(h('span', { class: 'badge warn', dataset: { verdict: 'straggler' } }, `straggler: rank ${list(doc.stragglers)}`));
  }
  if (!out.length) out.push(h('span', { class: 'badge ok', dataset: { verdict: 'ok' } }, `${formatNumber(doc.ranks.length)} ranks ok`));
  out.push(...failures(doc));
  out.push(h('span', { class: 'muted' }, ` hang timeout ${duration(doc.timeout_s)}`));
  return out;
}

function intervalLine(iv) {
  const m = iv.mtbf_source === 'prior' ? `${duration(iv.mtbf_s)} (the prior: no failure yet)`
    : `${duration(iv.mtbf_s)} (${iv.failures} failure${iv.failures === 1 ? '' : 's'} in ${duration(iv.exposure_s)})`;
  const parts = [h('span', {}, `checkpoint cost C ${iv.cost_s ? duration(iv.cost_s) : 'not measured yet'}`),
    h('span', {}, `time between failures M ${m}`)];
  if (iv.seconds !== null && iv.seconds !== undefined) {
    parts.unshift(h('strong', { class: 'interval' }, `auto interval τ ${duration(iv.seconds)}`
      + (iv.steps ? ` (≈ ${formatNumber(iv.steps)} steps)` : '')));
    parts.push(h('span', {}, `work lost per failure ${duration(iv.expected_loss_s)}`));
  }
  return parts.flatMap((p, i) => (i ? [h('span', { class: 'muted' }, ' · '), p] : [p]));
}

function rankTable(doc) {
  if (!doc.ranks.length) return null;
  const bad = doc.ranks.filter((r) => r.state !== 'ok');
  const shown = bad.concat(doc.ranks.filter((r) => r.state === 'ok').slice(0, Math.max(0, MAX_RANKS_SHOWN - bad.length)))
    .sort((a, b) => a.rank - b.rank);
  const rows = shown.map((r) => h('tr', { class: `rank st-${r.state}`, dataset: { rank: String(r.rank) } },
    h('td', { class: 'num' }, String(r.rank)),
    h('td', { class: 'num' }, r.step === null ? '–' : formatNumber(r.step)),
    h('td', {}, r.phase),
    h('td', { class: 'num' }, duration(r.typical_step_s ?? r.step_seconds)),
    h('td', { class: 'num' }, `${duration(r.age_s)} ago`),
    h('td', { class: 'num' }, duration(r.progress_age_s)),
    h('td', {}, h('span', { class: `badge ${r.state === 'ok' ? 'ok' : r.state === 'straggler' ? 'warn' : 'bad'}` }, r.state))));
  const more = doc.ranks.length - shown.length;
  return h('details', { class: 'ranks', open: bad.length > 0 },
    h('summary', {}, `ranks (${formatNumber(doc.ranks.length)})`),
    h('table', { class: 'ranks-table' },
      h('thead', {}, h('tr', {}, ['Rank', 'Step', 'Phase', 'Step time', 'Last beat', 'No progress', 'State']
        .map((t) => h('th', {}, t)))),
      h('tbody', {}, rows)),
    more > 0 ? h('p', { class: 'muted' }, `${formatNumber(more)} more ranks ok`) : null);
}

/** The panel's children for one health answer. */
export function healthPanel(doc) {
  return [h('div', { class: 'health-line' }, verdicts(doc)), h('div', { class: 'interval-line' }, intervalLine(doc.interval)),
    rankTable(doc)];
}
