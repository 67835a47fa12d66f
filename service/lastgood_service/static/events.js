// The run's events as sentences for the events list: each names steps (the graph's axis),
// never bare checkpoint ids, and says what happened; whatever a sentence leaves out is in
// the title (hover). Given-up saves of many ranks for the same steps are one incident.

import { clip, formatNumber } from './dom.js';

/** A number as people read it: at most five significant digits, thousands separated. */
export function num(x) {
  return typeof x === 'number' && Number.isFinite(x) ? x.toLocaleString('en-US', { maximumSignificantDigits: 5 }) : String(x);
}

const plural = (n, word) => `${formatNumber(n)} ${word}${n === 1 ? '' : 's'}`;

/** 3, 5, 8 → "steps 3, 5 and 8"; a long list by its ends. */
export function stepList(steps) {
  const s = [...new Set(steps.filter(Number.isFinite))].sort((a, b) => a - b);
  if (!s.length) return 'no step';
  if (s.length === 1) return `step ${formatNumber(s[0])}`;
  if (s.length > 4) return `${formatNumber(s.length)} steps, ${formatNumber(s[0])}–${formatNumber(s[s.length - 1])}`;
  return `steps ${s.slice(0, -1).map(formatNumber).join(', ')} and ${formatNumber(s[s.length - 1])}`;
}

const ranksText = (ranks) => {
  const r = [...new Set(ranks)].sort((a, b) => a - b);
  return r.length === 1 ? `rank ${r[0]}` : `${formatNumber(r.length)} ranks (${clip(r.join(', '), 40)})`;
};

/**
 * save_given_up events for the same steps (one per rank that gave them up) become one entry
 * with every rank; every other event stays as it is. Oldest first, as given.
 */
export function mergeGivenUp(events) {
  const out = [];
  const byKey = new Map();
  for (const e of events) {
    if (e.kind !== 'save_given_up') {
      out.push(e);
      continue;
    }
    const d = e.data || {};
    const key = JSON.stringify(d.steps || []);
    const seen = byKey.get(key);
    if (seen) {
      seen.data.ranks.push(d.rank);
      seen.at = e.at;
      continue;
    }
    const merged = { ...e, data: { ...d, ranks: [d.rank] } };
    byKey.set(key, merged);
    out.push(merged);
  }
  return out;
}

const SUMMARISED = {
  spike: ['step', 'metric', 'value', 'loss', 'median', 'mad', 'z', 'threshold', 'reason', 'rank', 'grad_norm',
    'lr_factor', 'rollback'],
  rollback: ['target_step', 'spike_step', 'lr_factor', 'skipped', 'suspect', 'last_good_before', 'last_good'],
  fenced: ['generation', 'attempt', 'by_generation', 'by_attempt', 'abandoned', 'last_good_id', 'last_good_step'],
  fenced_write: ['what', 'generation', 'step', 'rank'],
  verdict: ['rank', 'step', 'phase', 'age_s', 'progress_age_s', 'timeout_s', 'typical_step_s', 'generation'],
  restart: ['restart_count', 'max_restarts', 'world_size'],
  note: ['text', 'note', 'message'],
};

/** Whatever the sentence leaves out, as short JSON (a client may add its own fields). */
function remainder(kind, d) {
  const rest = Object.fromEntries(Object.entries(d).filter(([k]) => !SUMMARISED[kind].includes(k)));
  return Object.keys(rest).length ? [clip(JSON.stringify(rest), 200)] : [];
}

/**
 * An event as a sentence. `stepOf(checkpointId)` is the checkpoint's step (null when the
 * page has not loaded it).
 */
export function eventText(e, stepOf = () => null) {
  const d = e.data || {};
  const parts = [];
  const at = stepOf(e.checkpoint_id);
  const ofStep = Number.isFinite(d.step) ? d.step : at;
  const saveOf = ofStep === null || ofStep === undefined ? 'a save' : `the save of step ${formatNumber(ofStep)}`;
  if (e.kind === 'save_given_up') {
    const ranks = Array.isArray(d.ranks) ? d.ranks : [d.rank];
    const steps = Array.isArray(d.steps) ? d.steps : [];
    parts.push(`${ranksText(ranks)} gave up ${steps.length ? `the saves of ${stepList(steps)}` : plural(d.count || 0, 'save')}`
      + ' while the service was unreachable; training went on');
    if (d.reason) parts.push(clip(String(d.reason), 200));
    return parts.join(' · ');
  }
  if (e.kind === 'abort') {
    parts.push(`${saveOf} was aborted${d.rank != null ? ` by rank ${d.rank}` : ''}; last-good did not move`);
    if (d.reason) parts.push(clip(String(d.reason), 200));
    return parts.join(' · ');
  }
  if (e.kind === 'expired') {
    const voted = Array.isArray(d.voted_ranks) ? d.voted_ranks : [];
    parts.push(`${saveOf} expired: its lease ran out before every rank voted`
      + ` (${voted.length ? `${ranksText(voted)} had voted` : 'no rank had voted'}); last-good did not move`);
    return parts.join(' · ');
  }
  if (e.kind === 'corrupt') {
    parts.push(`the checkpoint of step ${at === null ? '?' : formatNumber(at)} is damaged`
      + (Array.isArray(d.bad) ? ` (${plural(d.bad.length, 'file')})` : ''));
    const back = stepOf(d.last_good);
    if (back !== null) parts.push(`last-good is step ${formatNumber(back)} again`);
    return parts.join(' · ');
  }
  if (e.kind === 'hash_mismatch') {
    parts.push(`rank ${d.rank}'s file ${clip(String(d.file), 60)} for ${saveOf.replace('the save', 'the checkpoint')}`
      + ' did not match the hash it declared; the upload was refused');
    return parts.join(' · ');
  }
  if (e.kind === 'restart') {
    parts.push(d.restart_count != null
      ? `torchrun restarted the job (restart ${d.restart_count}${d.max_restarts ? ` of ${d.max_restarts}` : ''})`
      : 'the job was launched again');
    if (at !== null) parts.push(`from step ${formatNumber(at)}`);
    if (d.world_size != null) parts.push(`${plural(d.world_size, 'rank')}`);
    return [...parts, ...remainder('restart', d)].join(' · ');
  }
  if (e.kind === 'note') {
    const text = d.text ?? d.note ?? d.message;
    if (text !== undefined) parts.push(clip(String(text), 300));
    if (at !== null) parts.push(`at step ${formatNumber(at)}`);
    return [...parts, ...remainder('note', d)].join(' · ');
  }
  if (e.kind === 'spike') {
    parts.push(`at step ${d.step}`);
    if (d.metric !== undefined) parts.push(`${d.metric} ${num(d.value)}`);
    else if (d.loss !== undefined) parts.push(`loss ${num(d.loss)}`);
    if (d.median !== undefined) parts.push(`median ${num(d.median)}`);
    if (d.z !== undefined) parts.push(`z ${num(d.z)}${d.threshold !== undefined ? ` > ${num(d.threshold)}` : ''}`);
    else if (d.reason) parts.push(String(d.reason));
    if (d.rank !== undefined) parts.push(`rank ${d.rank}`);
    return [...parts, ...remainder('spike', d)].join(' · ');
  }
  if (e.kind === 'rollback') {
    parts.push(`to step ${d.target_step}`, `spike at step ${d.spike_step}`);
    if (d.lr_factor != null) parts.push(`lr × ${num(d.lr_factor)}`);
    const sk = d.skipped || {};
    if (Array.isArray(sk.steps) && sk.steps.length === 2) parts.push(`steps ${sk.steps[0]}–${sk.steps[1]} skipped`);
    if (Array.isArray(sk.samples)) parts.push(`${plural(sk.samples.length, 'sample')} excluded`);
    if (Array.isArray(d.suspect)) parts.push(`${plural(d.suspect.length, 'checkpoint')} suspect`);
    return [...parts, ...remainder('rollback', d)].join(' · ');
  }
  if (e.kind === 'fenced') {
    parts.push(`generation ${d.generation} (launch ${d.attempt}) fenced by generation ${d.by_generation} (launch ${d.by_attempt})`);
    if (Array.isArray(d.abandoned) && d.abandoned.length) parts.push(`${plural(d.abandoned.length, 'pending save')} abandoned`);
    if (d.last_good_step != null) parts.push(`resumes from step ${d.last_good_step}`);
    return [...parts, ...remainder('fenced', d)].join(' · ');
  }
  if (e.kind === 'fenced_write') {
    parts.push(`refused a ${d.what} of generation ${d.generation} (a zombie of an earlier launch)`);
    if (d.step !== undefined) parts.push(`step ${d.step}`);
    if (d.rank !== undefined) parts.push(`rank ${d.rank}`);
    return [...parts, ...remainder('fenced_write', d)].join(' · ');
  }
  if (['hung', 'straggler', 'lost'].includes(e.kind)) {
    parts.push(`rank ${d.rank}`);
    if (d.step != null) parts.push(`after step ${d.step}`);
    if (e.kind === 'straggler' && d.typical_step_s != null) parts.push(`${num(d.typical_step_s)} s a step`);
    if (e.kind === 'hung') parts.push(`no progress for ${num(d.progress_age_s)} s (timeout ${num(d.timeout_s)} s)`);
    if (e.kind === 'lost') parts.push(`silent for ${num(d.age_s)} s`);
    return [...parts, ...remainder('verdict', d)].join(' · ');
  }
  if (e.kind.startsWith('supervisor_')) { // lastgood supervise (docs/supervise.md)
    parts.push(`launch ${d.launch} ${d.reason}`);
    if (Array.isArray(d.ranks) && d.ranks.length) parts.push(`local rank ${d.ranks.join(', ')} to blame`);
    if (d.next_world_size != null && d.next_world_size !== d.world_size) {
      parts.push(`relaunched on ${d.next_world_size} ranks (drained ${(d.drained || []).join(', ')})`);
    }
    if (d.restart != null) parts.push(`restart ${d.restart} of ${d.max_restarts}`);
    if (d.why) parts.push(String(d.why));
    if (d.detail) parts.push(clip(String(d.detail), 200));
    return parts.join(' · ');
  }
  const json = JSON.stringify(d);
  return json && json !== '{}' ? clip(json, 300) : '';
}
