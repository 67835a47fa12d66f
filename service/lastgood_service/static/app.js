// The lastgood web page: runs list, a run's lineage graph, a checkpoint's detail, GC view.
// Live: polls GET /api/v1/overview every 2 s and reloads a run's lineage only when its
// last event id changed. Plain ES modules, no build step; see vendor/README.md.

import { api, ApiError, AuthRequired, get, seg, setToken, token } from './api.js';
import { clip, fill, formatAgo, formatBytes, formatNumber, formatSeconds, h, show } from './dom.js';
import { eventText, mergeGivenUp } from './events.js';
import { buildModel, LineageGraph } from './graph.js';
import { healthPanel } from './health.js';

const POLL_MS = 2000;
const EVENT_KINDS = 'spike,rollback,restart,corrupt,abort,expired,hash_mismatch,note,fenced,fenced_write,hung,straggler,lost,'
  + 'save_given_up,supervisor_restart,supervisor_gave_up,supervisor_stopped';
const EVENT_NAMES = { save_given_up: 'saves given up' }; // an event kind's badge, where its name reads badly
const MAX_EVENTS_SHOWN = 200;
const LINEAGE_DRAWN = 10000; // the most checkpoints of a run the graph draws (the oldest)
const MAX_CURL_FILES = 8;

const $ = (id) => document.getElementById(id);

const state = {
  runs: [],
  run: null, // selected run name
  renderedSig: null, // the run's last_event_id/checkpoint count the graph shows
  lineage: null,
  events: [],
  model: null,
  collapse: true,
  expanded: new Set(),
  selected: null, // checkpoint id shown in the detail panel
  filesFor: null, // [checkpoint id, status] whose files are shown
  tab: 'events',
  gcPlan: null,
  authNeeded: false,
  busy: false,
  force: false,
};

let graph = null;

// ---------------------------------------------------------------- status line and auth
function setStatus(text, kind = 'info') {
  const el = $('status');
  el.textContent = text;
  el.className = `status ${kind}`;
}

function showAuth(err) {
  state.authNeeded = true;
  show($('auth'), true);
  $('auth-msg').textContent = err.hadToken
    ? `The service refused this token: ${err.message}`
    : 'This service needs a token for its API.';
  setStatus('waiting for a token', 'warn');
  $('auth-token').focus();
}

function onAuthSubmit(event) {
  event.preventDefault();
  const value = $('auth-token').value.trim();
  if (!value) return;
  setToken(value);
  $('auth-token').value = '';
  state.authNeeded = false;
  show($('auth'), false);
  updateSignOut();
  state.force = true;
  tick();
}

function updateSignOut() {
  show($('signout'), Boolean(token()));
}

function handleError(err, what) {
  if (err instanceof AuthRequired) {
    showAuth(err);
    return;
  }
  const message = err instanceof ApiError ? err.message : String(err && err.message ? err.message : err);
  setStatus(`${what}: ${message}`, 'error');
}

// ---------------------------------------------------------------- the location hash: #run=NAME&ckpt=ID&tab=gc
function readHash() {
  const params = new URLSearchParams(location.hash.slice(1));
  const ckpt = Number.parseInt(params.get('ckpt') || '', 10);
  return { run: params.get('run'), ckpt: Number.isFinite(ckpt) ? ckpt : null, tab: params.get('tab') === 'gc' ? 'gc' : 'events' };
}

function writeHash() {
  const params = new URLSearchParams();
  if (state.run) params.set('run', state.run);
  if (state.selected) params.set('ckpt', String(state.selected));
  if (state.tab === 'gc') params.set('tab', 'gc');
  const next = `#${params.toString()}`;
  if (location.hash !== next) history.replaceState(null, '', next);
}

function applyHash() {
  const { run, ckpt, tab } = readHash();
  if (run !== state.run) selectRun(run, false);
  state.selected = ckpt;
  setTab(tab, false);
}

// ---------------------------------------------------------------- polling
async function tick() {
  if (state.busy || state.authNeeded) return;
  state.busy = true;
  try {
    const overview = await get('/api/v1/overview?limit=1000');
    state.runs = overview.items;
    renderRuns(overview);
    if (state.run) {
      const item = state.runs.find((r) => r.name === state.run);
      const sig = item ? `${item.last_event_id}/${item.total_checkpoints}` : 'missing';
      if (!item) {
        setStatus(`run ${state.run} does not exist (yet)`, 'warn');
      } else if (sig !== state.renderedSig || state.force) {
        await loadRun(sig);
      }
      if (item) await loadHealth(state.run);
    }
    state.force = false;
    if (!state.run || state.runs.some((r) => r.name === state.run)) {
      setStatus(`updated ${new Date().toLocaleTimeString('en-GB')}`);
    }
  } catch (err) {
    handleError(err, 'update failed');
  } finally {
    state.busy = false;
  }
}

async function loadEvents(run) {
  const base = `/api/v1/runs/${seg(run)}/events?kind=${EVENT_KINDS}&limit=1000`;
  const first = await get(base);
  if (first.total <= first.items.length) return first.items;
  return (await get(`${base}&offset=${first.total - 1000}`)).items; // the newest 1000
}

/** The run's lineage, page by page (the service answers at most a page at a time), up to
 * the LINEAGE_DRAWN oldest checkpoints: the graph draws no more. */
async function loadLineage(run) {
  const base = `/api/v1/runs/${seg(run)}/lineage`;
  let page = await get(base);
  const nodes = [...page.nodes];
  const edges = [...page.edges];
  while (page.nodes.length && nodes.length < Math.min(page.total, LINEAGE_DRAWN)) {
    page = await get(`${base}?offset=${nodes.length}`);
    nodes.push(...page.nodes);
    edges.push(...page.edges);
  }
  return { ...page, nodes, edges, offset: 0 };
}

async function loadRun(sig) {
  const run = state.run;
  const [lineage, events, retention] = await Promise.all([loadLineage(run), loadEvents(run),
    get(`/api/v1/runs/${seg(run)}/retention`)]);
  if (run !== state.run) return; // another run was chosen meanwhile
  fill($('run-retention'), 'Retention: ', h('code', {}, retention.retention),
    retention.own ? ' (this run\'s own)' : ' (the service default)');
  state.lineage = lineage;
  state.events = events;
  state.renderedSig = sig;
  renderGraph();
  renderEvents();
  renderDetail();
  if (state.tab === 'gc') await loadGc();
}

/** Health changes without events (ages grow, steps advance): read every poll. */
async function loadHealth(run) {
  const doc = await get(`/api/v1/runs/${seg(run)}/health`);
  if (run === state.run) fill($('run-health'), healthPanel(doc));
}

// ---------------------------------------------------------------- runs list
function health(run) {
  const out = [];
  if (run.recent_failures > 0) {
    out.push(h('span', { class: 'badge bad', title: run.last_failure_at ? `last ${run.last_failure_at}` : null },
      `${run.recent_failures} failure${run.recent_failures === 1 ? '' : 's'} (24 h)`));
  }
  if (run.pending > 0) out.push(h('span', { class: 'badge warn' }, `${run.pending} saving`));
  if (run.spikes > 0 || run.rollbacks > 0) {
    const plural = (n, word) => `${formatNumber(n)} ${word}${n === 1 ? '' : 's'}`;
    out.push(h('span', { class: 'badge warn', title: 'loss spikes the SpikeGuard rolled back from (ever)' },
      `${plural(run.spikes || 0, 'spike')}, ${plural(run.rollbacks || 0, 'rollback')}`));
  }
  if (!out.length) out.push(h('span', { class: 'badge ok' }, 'ok'));
  return out;
}

function renderRuns(overview) {
  const tbody = $('runs-body');
  const rows = overview.items.map((run) => h('tr', {
    class: run.name === state.run ? 'run-row selected' : 'run-row',
    'aria-selected': run.name === state.run ? 'true' : 'false',
    dataset: { run: run.name },
  },
  h('td', {}, h('button', { class: 'link run-link', type: 'button', onclick: () => selectRun(run.name, true) }, run.name)),
  h('td', { class: 'num' }, run.last_good ? formatNumber(run.last_good.step) : '–'),
  h('td', { class: 'num' }, formatNumber(run.total_checkpoints)),
  h('td', { class: 'num' }, formatBytes(run.bytes_stored)),
  h('td', { title: run.last_activity }, formatAgo(run.last_activity)),
  h('td', { class: 'health' }, health(run))));
  fill(tbody, rows);
  show($('runs-empty'), overview.items.length === 0);
  $('runs-count').textContent = overview.total > overview.items.length
    ? `${formatNumber(overview.items.length)} of ${formatNumber(overview.total)}` : formatNumber(overview.total);
}

function selectRun(name, user) {
  if (name === state.run) return;
  state.run = name || null;
  state.renderedSig = null;
  state.lineage = null;
  state.expanded = new Set();
  state.gcPlan = null;
  fill($('run-health'));
  if (user) state.selected = null;
  show($('run-pane'), Boolean(state.run));
  $('run-title').textContent = state.run || '';
  for (const tr of document.querySelectorAll('#runs-body tr')) {
    const on = tr.dataset.run === state.run;
    tr.classList.toggle('selected', on);
    tr.setAttribute('aria-selected', on ? 'true' : 'false');
  }
  if (graph) graph.autoFit = true;
  if (!state.selected) show($('detail'), false);
  writeHash();
  if (user) tick();
}

// ---------------------------------------------------------------- the graph
function renderGraph() {
  if (!state.lineage) return;
  state.model = buildModel(state.lineage, state.events, { collapse: state.collapse, expanded: state.expanded });
  graph.render(state.model);
  if (state.selected) graph.select(state.model.keyOf(state.selected));
  if (state.tab === 'gc') markDoomed();
  const snap = state.model.snapshot;
  const folded = state.model.groups.reduce((a, g) => a + g.members.length, 0);
  const parts = [`${formatNumber(snap.total)} checkpoints`, `${snap.branches} branch${snap.branches === 1 ? '' : 'es'}`];
  if (folded) parts.push(`${formatNumber(folded)} folded into ${state.model.groups.length} groups (click one to unfold)`);
  if (snap.loaded < snap.total) parts.push(`only the first ${formatNumber(snap.loaded)} are drawn`);
  $('graph-summary').textContent = parts.join(' · ');
}

function onTapGroup(key) {
  const g = state.model && state.model.groups.find((x) => x.key === key);
  if (!g) return;
  for (const id of g.members) state.expanded.add(id);
  renderGraph();
  setStatus(`unfolded ${formatNumber(g.members.length)} checkpoints`);
}

// ---------------------------------------------------------------- events list
/** The step of a checkpoint the page has loaded, else null. */
function stepOf(id) {
  const n = id != null && state.model ? state.model.nodes.get(id) : null;
  return n ? n.step : null;
}

/** Newest first; an event's checkpoint by its step (the graph's axis), a link to its detail. */
function renderEvents() {
  const items = mergeGivenUp(state.events).slice(-MAX_EVENTS_SHOWN).reverse().map((e) => {
    const step = stepOf(e.checkpoint_id);
    return h('li', { class: `event ev-${e.kind}` },
      h('span', { class: 'when', title: e.at }, formatAgo(e.at)),
      h('span', { class: `badge kind ev-${e.kind}` }, EVENT_NAMES[e.kind] || e.kind),
      e.checkpoint_id ? h('button', { type: 'button', class: 'link', title: `checkpoint ${e.checkpoint_id}`,
        onclick: () => openCheckpoint(e.checkpoint_id) }, step === null ? `checkpoint ${e.checkpoint_id}` : `step ${formatNumber(step)}`) : null,
      h('span', { class: 'event-data', title: clip(JSON.stringify(e.data || {}), 2000) }, eventText(e, stepOf)));
  });
  fill($('events'), items.length ? items : h('li', { class: 'muted' }, 'No spikes, rollbacks, restarts, fencing or failures.'));
}

// ---------------------------------------------------------------- checkpoint detail
function openCheckpoint(id) {
  state.selected = id;
  writeHash();
  if (state.model) {
    if (state.model.groupOf.has(id)) { // unfold the group that hides it
      const key = state.model.groupOf.get(id);
      onTapGroup(key);
    }
    graph.select(state.model.keyOf(id));
  }
  state.filesFor = null;
  renderDetail();
}

function closeDetail() {
  state.selected = null;
  graph.select(null);
  show($('detail'), false);
  writeHash();
}

function row(label, ...value) {
  return [h('dt', {}, label), h('dd', {}, ...value)];
}

function renderDetail() {
  const panel = $('detail');
  const node = state.model && state.selected ? state.model.nodes.get(state.selected) : null;
  if (!node) {
    show(panel, false);
    return;
  }
  show(panel, true);
  panel.dataset.checkpoint = String(node.id);
  $('detail-title').textContent = `Checkpoint ${node.id} · step ${formatNumber(node.step)}`;
  const parent = node.parent_id
    ? h('button', { type: 'button', class: 'link', onclick: () => openCheckpoint(node.parent_id) }, `checkpoint ${node.parent_id}`)
    : 'none (a root)';
  fill($('detail-info'), h('dl', {},
    row('Status', h('span', { class: `badge st-${node.display}` }, node.display), node.last_good ? h('span', { class: 'badge lg' }, 'last-good') : null),
    row('Run', state.run),
    row('Step', formatNumber(node.step)),
    row('Parent', parent),
    row('Branch', String(node.branch)),
    row('World size', String(node.world_size)),
    row('Attempt', node.attempt),
    row('Size', formatBytes(node.bytes)),
    row('Created', node.created_at),
    row('Committed', node.committed_at || '–'),
    row('Save', formatSeconds(node.save_seconds), h('span', { class: 'muted' }, ' begin → commit')),
    row('Commit', formatSeconds(node.commit_seconds), h('span', { class: 'muted' }, ' last vote → commit'))));

  const tags = node.tags.map((t) => h('li', { class: `tag kind-${t.kind}` },
    h('span', { class: 'tag-name' }, t.kind === 'pin' ? 'pinned' : t.name),
    h('span', { class: 'tag-kind' }, t.kind),
    t.kind === 'tag' || t.kind === 'alias'
      ? h('button', { type: 'button', class: 'remove', title: `remove tag ${t.name}`, 'aria-label': `remove tag ${t.name}`,
        onclick: () => act(() => api('DELETE', `/api/v1/checkpoints/${node.id}/tags/${seg(t.name)}`), `removed tag ${t.name}`) }, '×')
      : null));
  fill($('detail-tags'), tags.length ? tags : h('li', { class: 'muted' }, 'no tags'));

  const taggable = node.status === 'COMMITTED' || node.status === 'CORRUPT';
  show($('tag-form'), taggable);
  const pinned = node.tags.some((t) => t.kind === 'pin');
  const pin = $('pin-button');
  pin.textContent = pinned ? 'Unpin' : 'Pin';
  pin.dataset.pinned = pinned ? 'true' : 'false';
  show(pin, taggable || pinned);

  if (!state.filesFor || state.filesFor[0] !== node.id || state.filesFor[1] !== node.status) loadFiles(node);
  else renderRestore(node, state.filesFor[2]);
}

async function loadFiles(node) {
  state.filesFor = [node.id, node.status, null];
  fill($('detail-files'), h('p', { class: 'muted' }, 'loading files…'));
  try {
    const shards = await get(`/api/v1/checkpoints/${node.id}/shards`);
    if (state.selected !== node.id) return;
    state.filesFor = [node.id, node.status, shards];
    const rows = [];
    for (const r of shards.ranks) {
      if (!r.files.length) rows.push(h('tr', {}, h('td', { class: 'num' }, String(r.rank)), h('td', { colspan: 4, class: 'muted' }, 'no files')));
      for (const f of r.files) {
        rows.push(h('tr', {}, h('td', { class: 'num' }, String(r.rank)), h('td', { class: 'mono' }, f.name),
          h('td', { class: 'num' }, formatBytes(f.size)), h('td', { class: 'mono hash' }, f.xxh3_128),
          h('td', {}, f.status.toLowerCase())));
      }
    }
    fill($('detail-files'), rows.length
      ? h('table', { class: 'files' }, h('thead', {}, h('tr', {}, h('th', {}, 'rank'), h('th', {}, 'file'), h('th', {}, 'size'),
        h('th', {}, 'xxh3-128'), h('th', {}, 'state'))), h('tbody', {}, rows))
      : h('p', { class: 'muted' }, 'no files uploaded'));
    renderRestore(node, shards);
  } catch (err) {
    handleError(err, 'loading files failed');
  }
}

function q(s) {
  return `'${String(s).replace(/'/g, "'\\''")}'`; // a shell word
}

function renderRestore(node, shards) {
  const box = $('detail-restore');
  if (node.status !== 'COMMITTED') {
    fill(box, h('p', { class: 'muted' }, `Not restorable: this checkpoint is ${node.display}.`));
    return;
  }
  const base = `${location.origin}/api/v1/checkpoints/${node.id}`;
  const withToken = Boolean(token());
  const python = [
    'import lastgood',
    '',
    withToken ? '# the service wants a token: the Checkpointer reads LASTGOOD_TOKEN (or pass token=...)' : null,
    `ckpt = lastgood.Checkpointer(${JSON.stringify(location.origin)}, run=${JSON.stringify(state.run)})`,
    `step = ckpt.restore(state, checkpoint_id=${node.id})  # state: your lastgood.TrainState; returns ${node.step}`,
  ].filter((line) => line !== null).join('\n');
  const cli = `${withToken ? 'LASTGOOD_TOKEN=... ' : ''}lastgood --url ${q(location.origin)} download ${node.id} ./ckpt-${node.id}`;
  const auth = withToken ? ' -H "Authorization: Bearer $LASTGOOD_TOKEN"' : '';
  const files = shards ? shards.ranks.flatMap((r) => r.files.map((f) => [r.rank, f.name])) : [];
  const curl = [`curl -s${auth} ${q(`${base}/manifest`)} -o manifest-${node.id}.json`];
  for (const [rank, name] of files.slice(0, MAX_CURL_FILES)) {
    curl.push(`curl -s -O -J${auth} ${q(`${base}/ranks/${rank}/files/${seg(name)}`)}`);
  }
  if (files.length > MAX_CURL_FILES) curl.push(`# … ${files.length - MAX_CURL_FILES} more files: the manifest lists them all`);
  const snippet = (title, text, id) => h('div', { class: 'snippet' },
    h('div', { class: 'snippet-head' }, h('span', {}, title),
      h('button', { type: 'button', class: 'copy', onclick: () => copy(text) }, 'Copy')),
    h('pre', { id, class: 'code' }, text));
  fill(box, snippet('Python: restore in place (every byte re-hashed)', python, 'restore-python'),
    snippet('Command line: download every file, verified', cli, 'restore-cli'),
    snippet('curl: the manifest and each file', curl.join('\n'), 'restore-curl'));
}

async function copy(text) {
  try {
    await navigator.clipboard.writeText(text);
    setStatus('copied');
  } catch {
    setStatus('copying needs a secure page (https or localhost); select the text instead', 'warn');
  }
}

async function act(call, done) {
  const msg = $('action-msg');
  msg.className = 'action-msg';
  msg.textContent = 'working…';
  try {
    await call();
    msg.textContent = done;
    state.force = true;
    await tick();
  } catch (err) {
    if (err instanceof AuthRequired) {
      showAuth(err);
      msg.textContent = '';
    } else {
      msg.className = 'action-msg error';
      msg.textContent = err instanceof ApiError && err.status === 403 ? `Not allowed: ${err.message}` : err.message;
    }
  }
}

function onTagSubmit(event) {
  event.preventDefault();
  const id = state.selected;
  const name = $('tag-name').value.trim();
  const alias = $('tag-alias').checked;
  if (!id || !name) return;
  act(async () => {
    await api('POST', `/api/v1/checkpoints/${id}/tags`, { name, alias });
    $('tag-name').value = '';
  }, `${alias ? 'alias' : 'tag'} ${name} set`);
}

function onPin() {
  const id = state.selected;
  if (!id) return;
  const pinned = $('pin-button').dataset.pinned === 'true';
  act(() => api(pinned ? 'DELETE' : 'PUT', `/api/v1/checkpoints/${id}/pin`), pinned ? 'unpinned' : 'pinned');
}

// ---------------------------------------------------------------- garbage collection
function setTab(tab, user) {
  state.tab = tab;
  for (const [name, el] of [['events', $('tab-events')], ['gc', $('tab-gc')]]) {
    el.setAttribute('aria-selected', name === tab ? 'true' : 'false');
  }
  show($('events-view'), tab === 'events');
  show($('gc-view'), tab === 'gc');
  writeHash();
  if (tab === 'gc' && user) loadGc().catch((err) => handleError(err, 'loading the GC plan failed'));
  if (tab !== 'gc' && graph) graph.markDoomed(null);
}

async function loadGc() {
  const [policy, plan] = await Promise.all([get('/api/v1/gc/policy'), get('/api/v1/gc/plan')]);
  state.gcPlan = plan;
  fill($('gc-policy'),
    h('p', {}, 'Retention: ', h('code', {}, policy.retention)),
    h('ul', {}, policy.policies.map((p) => h('li', {}, h('code', {}, p.spec), ` ${p.keeps}`))),
    h('p', { class: 'muted' }, `Abandoned and corrupt checkpoints are kept at least ${formatSeconds(policy.grace_seconds)}; `
      + (policy.interval_seconds > 0 ? `GC runs every ${formatSeconds(policy.interval_seconds)}.` : 'scheduled GC is off.')));
  renderPlan();
  markDoomed();
}

function renderPlan() {
  const plan = state.gcPlan;
  if (!plan) return;
  const onlyRun = $('gc-this-run').checked;
  const items = plan.checkpoints.filter((d) => !onlyRun || d.run === state.run);
  const bytes = items.reduce((a, d) => a + d.bytes, 0);
  $('gc-summary').textContent = `${formatNumber(items.length)} checkpoint${items.length === 1 ? '' : 's'} would be deleted, `
    + `${formatBytes(bytes)} freed${onlyRun ? ' in this run' : ''}; all runs: ${formatBytes(plan.bytes_freed)}`
    + ` (${formatNumber(plan.orphans.length)} orphan blobs, ${formatNumber(plan.unknown.length)} unknown left alone).`;
  $('gc-summary').dataset.bytesFreed = String(plan.bytes_freed);
  const rows = items.slice(0, 1000).map((d) => h('tr', { dataset: { checkpoint: String(d.checkpoint_id) } },
    h('td', { class: 'num' }, d.run === state.run
      ? h('button', { type: 'button', class: 'link', onclick: () => openCheckpoint(d.checkpoint_id) }, String(d.checkpoint_id))
      : String(d.checkpoint_id)),
    h('td', {}, d.run), h('td', { class: 'num' }, formatNumber(d.step)), h('td', {}, d.status.toLowerCase()),
    h('td', {}, d.reason), h('td', { class: 'num' }, formatBytes(d.bytes))));
  fill($('gc-body'), rows);
  show($('gc-table'), rows.length > 0);
}

function markDoomed() {
  if (!state.gcPlan || !graph) return;
  graph.markDoomed(state.gcPlan.checkpoints.filter((d) => d.run === state.run).map((d) => d.checkpoint_id));
}

// ---------------------------------------------------------------- start
function start() {
  graph = new LineageGraph($('graph'), { onTapCheckpoint: openCheckpoint, onTapGroup });
  // read-only hooks for the browser tests: a copy of what is drawn, and where
  Object.defineProperty(window, 'lastgoodGraph', {
    value: Object.freeze({
      snapshot: () => (state.model ? JSON.parse(JSON.stringify(state.model.snapshot)) : null),
      renderedPosition: (key) => graph.renderedPosition(key),
      shape: (key) => graph.shape(key),
      version: () => graph.version,
      doomed: () => graph.doomedKeys(),
    }),
  });
  $('auth-form').addEventListener('submit', onAuthSubmit);
  $('signout').addEventListener('click', () => {
    setToken(null);
    updateSignOut();
    state.force = true;
    tick();
  });
  $('fit').addEventListener('click', () => graph.fit());
  $('zoom-in').addEventListener('click', () => graph.zoomBy(1.4));
  $('zoom-out').addEventListener('click', () => graph.zoomBy(1 / 1.4));
  $('collapse').addEventListener('change', (e) => {
    state.collapse = e.target.checked;
    state.expanded = new Set();
    graph.autoFit = true;
    renderGraph();
  });
  $('detail-close').addEventListener('click', closeDetail);
  $('tag-form').addEventListener('submit', onTagSubmit);
  $('pin-button').addEventListener('click', onPin);
  $('tab-events').addEventListener('click', () => setTab('events', true));
  $('tab-gc').addEventListener('click', () => setTab('gc', true));
  $('gc-this-run').addEventListener('change', renderPlan);
  $('gc-refresh').addEventListener('click', () => loadGc().catch((err) => handleError(err, 'loading the GC plan failed')));
  window.addEventListener('hashchange', () => {
    applyHash();
    state.force = true;
    tick();
  });
  updateSignOut();
  applyHash();
  tick();
  setInterval(tick, POLL_MS);
}

start();
