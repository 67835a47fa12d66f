// The lineage graph: a pure model (which checkpoints are shown, which are collapsed, where
// events sit on the timeline) and its drawing with cytoscape.js + the dagre layout.
//
// Layout: dagre, left to right. Every edge's minimum length is the number of distinct steps
// it spans among the shown elements, and a hidden root holds every real root at its step, so
// a node's column is its step's rank: checkpoints of the same step line up across branches.
//
// User strings (tags, event data) only ever reach cytoscape as element data, which it draws
// on a canvas as text; they never become markup.

import { clip, formatNumber } from './dom.js';
import { LAYOUT, MIN_FIT_ZOOM, STYLE } from './graph-style.js';

/** Statuses whose long unbroken chains fold into one group node. */
export const COLLAPSIBLE = new Set(['committed', 'deleted', 'suspect']);
/** Shortest chain worth folding. */
export const MIN_FOLD = 3;
/** Event kinds marked on the timeline above the graph. */
export const MARKER_KINDS = new Set(['spike', 'rollback', 'restart', 'corrupt', 'fenced', 'save_given_up']);

/** Steps whose saves were given up (save_given_up events, any rank), sorted. */
export function givenUpSteps(events) {
  const steps = new Set();
  for (const e of events) {
    if (e.kind !== 'save_given_up') continue;
    for (const s of (e.data || {}).steps || []) if (Number.isFinite(s)) steps.add(s);
  }
  return [...steps].sort((a, b) => a - b);
}

export function displayStatus(node) {
  const status = String(node.status).toLowerCase();
  if (status === 'committed' && node.tags.some((t) => t.kind === 'system' && t.name === 'suspect')) return 'suspect';
  return status;
}

/**
 * The launch an attempt id belongs to. After a restore inside a running job (a SpikeGuard
 * rollback) the Checkpointer saves under `<launch>.<n>` (client/lastgood/checkpointer.py,
 * Checkpointer.attempt), so only a change of launch means the job was launched again.
 */
export function launchOf(attempt) {
  return String(attempt ?? '').replace(/\.\d+$/, '');
}

function push(map, key, value) {
  const list = map.get(key);
  if (list) list.push(value);
  else map.set(key, [value]);
}

function tagWords(tags) {
  const words = [];
  for (const t of tags) {
    if (t.name === 'last-good' || t.name === 'suspect') continue; // shown by colour and border
    if (t.kind === 'pin') words.push('pinned');
    else if (t.kind === 'alias') words.push(`@${clip(t.name, 20)}`);
    else if (t.kind === 'system') words.push(t.name);
    else words.push(`#${clip(t.name, 20)}`);
  }
  return words.length > 3 ? [...words.slice(0, 3), `+${words.length - 3}`] : words;
}

/**
 * lineage (GET /runs/{run}/lineage) + events (GET /runs/{run}/events?kind=...) -> the model.
 * options.collapse folds unremarkable chains; options.expanded holds checkpoint ids the user
 * unfolded (they stay unfolded across live updates).
 */
export function buildModel(lineage, events, { collapse = true, expanded = new Set() } = {}) {
  const nodes = new Map();
  for (const n of lineage.nodes) nodes.set(n.id, { ...n, display: displayStatus(n) });
  const children = new Map();
  for (const n of nodes.values()) if (nodes.has(n.parent_id)) push(children, n.parent_id, n.id);

  const anchored = new Set(events.filter((e) => e.checkpoint_id != null).map((e) => e.checkpoint_id));
  const restarted = new Set(); // a new launch: the job was launched again
  const branchStart = new Set();
  const rollbackTargets = new Set(events.filter((e) => e.kind === 'rollback').map((e) => e.checkpoint_id));
  for (const n of nodes.values()) {
    const p = nodes.get(n.parent_id);
    if (p && launchOf(p.attempt) !== launchOf(n.attempt)) restarted.add(n.id);
    if (p && p.branch !== n.branch) branchStart.add(n.id);
  }
  // a gap: saves given up between a checkpoint and its child (an outage); both stay
  // unfolded and the edge between them says how many steps' saves are missing
  const lost = givenUpSteps(events);
  const gapInto = new Map(); // child id -> the given-up steps between its parent and it
  const gapFrom = new Set();
  for (const n of nodes.values()) {
    const p = nodes.get(n.parent_id);
    if (!p) continue;
    const between = lost.filter((st) => st > p.step && st < n.step);
    if (between.length) {
      gapInto.set(n.id, between);
      gapFrom.add(p.id);
    }
  }
  const kids = (id) => children.get(id) || [];
  const remarkable = (n) => !collapse || gapInto.has(n.id) || gapFrom.has(n.id) || kids(n.id).length !== 1 || !nodes.has(n.parent_id)
    || !COLLAPSIBLE.has(n.display) || n.last_good || expanded.has(n.id) || anchored.has(n.id)
    || restarted.has(n.id) || branchStart.has(n.id)
    || n.tags.some((t) => !(t.kind === 'system' && t.name === 'suspect'));

  // fold chains of unremarkable checkpoints with one status into groups
  const groupOf = new Map();
  const groups = [];
  for (const n of nodes.values()) {
    if (remarkable(n) || groupOf.has(n.id)) continue;
    const p = nodes.get(n.parent_id);
    if (!remarkable(p) && p.display === n.display) continue; // not the start of its chain
    const members = [n];
    for (let cur = n; kids(cur.id).length === 1;) {
      const next = nodes.get(kids(cur.id)[0]);
      if (remarkable(next) || next.display !== n.display) break;
      members.push(next);
      cur = next;
    }
    if (members.length < MIN_FOLD) continue;
    const g = {
      key: `g${n.id}`, members: members.map((m) => m.id), display: n.display,
      firstStep: members[0].step, lastStep: members[members.length - 1].step,
      bytes: members.reduce((a, m) => a + (m.bytes || 0), 0),
    };
    for (const m of members) groupOf.set(m.id, g.key);
    groups.push(g);
  }
  const keyOf = (id) => groupOf.get(id) || `c${id}`;

  // what is shown: checkpoints not folded, groups, and the edges between them
  const shown = [];
  for (const n of nodes.values()) if (!groupOf.has(n.id)) shown.push({ key: `c${n.id}`, step: n.step, node: n });
  for (const g of groups) shown.push({ key: g.key, step: g.firstStep, group: g });
  const edges = [];
  const seen = new Set();
  for (const n of nodes.values()) {
    if (!nodes.has(n.parent_id)) continue;
    const from = keyOf(n.parent_id);
    const to = keyOf(n.id);
    if (from === to || seen.has(`${from}>${to}`)) continue;
    seen.add(`${from}>${to}`);
    edges.push({ from, to, faint: n.display === 'abandoned' || n.display === 'pending', gap: gapInto.get(n.id) || null });
  }

  // columns: the rank of each shown element's step
  const steps = [...new Set(shown.map((s) => s.step))].sort((a, b) => a - b);
  const column = new Map(steps.map((s, i) => [s, i]));
  const stepOf = new Map(shown.map((s) => [s.key, s.step]));
  const hasParent = new Set(edges.map((e) => e.to));

  // the timeline: events, plus relaunches seen as a change of attempt
  const markers = [];
  const stepOfCheckpoint = (id) => (nodes.has(id) ? nodes.get(id).step : null);
  for (const e of events) {
    if (!MARKER_KINDS.has(e.kind)) continue;
    const d = e.data || {};
    let step = null;
    let label = e.kind;
    let anchor = e.checkpoint_id; // the checkpoint the marker points at
    if (e.kind === 'spike') {
      step = Number.isFinite(d.step) ? d.step : null;
      label = `spike @ ${step === null ? '?' : formatNumber(step)}`;
    } else if (e.kind === 'rollback') {
      step = Number.isFinite(d.spike_step) ? d.spike_step : stepOfCheckpoint(e.checkpoint_id);
      label = `rollback → ${Number.isFinite(d.target_step) ? formatNumber(d.target_step) : '?'}`;
    } else if (e.kind === 'save_given_up') {
      const given = (d.steps || []).filter(Number.isFinite);
      if (!given.length) continue;
      step = Math.min(...given);
      const key = `${step}-${given.length}`; // every rank gives up the same saves: one marker for them
      if (markers.some((m) => m.kind === 'save_given_up' && m.dedup === key)) continue;
      label = `${given.length} save${given.length === 1 ? '' : 's'} given up`;
      markers.push({ key: `e${e.id}`, kind: e.kind, step, label, target: null, checkpointId: null, dedup: key });
      continue;
    } else if (e.kind === 'fenced') {
      // a relaunch fenced the launch before it; it resumes from the last-good it found
      step = Number.isFinite(d.last_good_step) ? d.last_good_step : null;
      label = `fenced gen ${Number.isFinite(d.generation) ? d.generation : '?'}`;
      anchor = d.last_good_id;
    } else {
      step = stepOfCheckpoint(e.checkpoint_id);
    }
    if (step === null) continue;
    markers.push({ key: `e${e.id}`, kind: e.kind, step, label, target: nodes.has(anchor) ? keyOf(anchor) : null,
      checkpointId: anchor ?? null });
  }
  const restartEvents = new Set(markers.filter((m) => m.kind === 'restart').map((m) => m.checkpointId));
  for (const id of restarted) {
    if (restartEvents.has(id)) continue;
    markers.push({ key: `a${id}`, kind: 'restart', step: nodes.get(id).step, label: 'restart', target: keyOf(id), checkpointId: id });
  }

  // cytoscape elements
  const elements = [{ group: 'nodes', data: { id: 'root' }, classes: 'lineage vroot' }];
  const labels = new Map();
  for (const s of shown) {
    if (s.node) {
      const n = s.node;
      const lines = [`step ${formatNumber(n.step)}`];
      if (n.display !== 'committed') lines.push(n.display);
      if (n.tier === 'memory') lines.push('memory');
      if (n.last_good) lines.push('★ last-good');
      if (branchStart.has(n.id)) {
        lines.push(rollbackTargets.has(n.parent_id) && !restarted.has(n.id) ? `branch ${n.branch} (rollback)` : `branch ${n.branch}`);
      }
      if (restarted.has(n.id)) lines.push('restart');
      const words = tagWords(n.tags);
      if (words.length) lines.push(words.join(' '));
      const classes = ['lineage', 'checkpoint', `st-${n.display}`];
      if (n.tier === 'memory') classes.push('tier-memory');
      if (n.last_good) classes.push('last-good');
      if (n.tags.some((t) => t.kind === 'pin')) classes.push('pinned');
      labels.set(s.key, lines.join('\n'));
      elements.push({ group: 'nodes', data: { id: s.key, checkpointId: n.id, step: n.step, label: lines.join('\n') },
        classes: classes.join(' ') });
    } else {
      const g = s.group;
      const label = `${formatNumber(g.members.length)} ${g.display === 'committed' ? '' : `${g.display} `}checkpoints\n`
        + `steps ${formatNumber(g.firstStep)}–${formatNumber(g.lastStep)}`;
      elements.push({ group: 'nodes', data: { id: g.key, step: g.firstStep, label, count: g.members.length },
        classes: `lineage group st-${g.display}` });
    }
  }
  for (const e of edges) {
    // a gap is drawn one column longer: the missing saves take room on the axis
    const span = Math.max(1, column.get(stepOf.get(e.to)) - column.get(stepOf.get(e.from))) + (e.gap ? 1 : 0);
    const data = { id: `${e.from}-${e.to}`, source: e.from, target: e.to, minLen: span };
    if (e.gap) data.label = `${e.gap.length} given up`;
    elements.push({ group: 'edges', data, classes: `lineage${e.faint ? ' faint' : ''}${e.gap ? ' gap' : ''}` });
  }
  for (const s of shown) {
    if (hasParent.has(s.key)) continue;
    elements.push({ group: 'edges', data: { id: `root-${s.key}`, source: 'root', target: s.key, minLen: column.get(s.step) + 1 },
      classes: 'lineage vroot' });
  }

  const snapshot = {
    run: lineage.run,
    total: lineage.total,
    loaded: lineage.nodes.length,
    lastGoodId: lineage.last_good_id,
    branches: lineage.branches,
    collapsed: groups.length > 0,
    nodes: shown.map((s) => (s.node
      ? { key: s.key, kind: 'checkpoint', id: s.node.id, step: s.node.step, status: s.node.display,
        parentId: s.node.parent_id, branch: s.node.branch, lastGood: s.node.last_good, tier: s.node.tier,
        tags: s.node.tags.map((t) => t.name), label: labels.get(s.key) }
      : { key: s.key, kind: 'group', status: s.group.display, count: s.group.members.length,
        firstStep: s.group.firstStep, lastStep: s.group.lastStep, members: s.group.members })),
    edges: edges.map((e) => (e.gap ? { from: e.from, to: e.to, gap: e.gap } : { from: e.from, to: e.to })),
    markers: markers.map((m) => ({ kind: m.kind, step: m.step, label: m.label, target: m.target })),
  };
  return { nodes, groups, groupOf, shown, edges, markers, elements, snapshot, keyOf };
}

/** x on the timeline for a step: interpolated between the shown elements around it. */
function stepToX(points, step) {
  if (!points.length) return 0;
  if (step <= points[0][0]) return points[0][1];
  for (let i = 1; i < points.length; i += 1) {
    const [s1, x1] = points[i];
    if (step <= s1) {
      const [s0, x0] = points[i - 1];
      return s1 === s0 ? x1 : x0 + ((x1 - x0) * (step - s0)) / (s1 - s0);
    }
  }
  return points[points.length - 1][1];
}

export class LineageGraph {
  constructor(container, { onTapCheckpoint, onTapGroup }) {
    this.container = container;
    this.version = 0;
    this.model = null;
    this.autoFit = true;
    this.cy = window.cytoscape({
      container, style: STYLE, elements: [], minZoom: 0.03, maxZoom: 4,
      boxSelectionEnabled: false, autoungrabify: true, selectionType: 'single',
    });
    this.cy.on('tap', 'node.checkpoint', (e) => onTapCheckpoint(e.target.data('checkpointId')));
    this.cy.on('tap', 'node.group', (e) => onTapGroup(e.target.id()));
    this.cy.on('tap', 'node.marker', (e) => {
      const id = e.target.data('checkpointId');
      if (id) onTapCheckpoint(id);
    });
    // the user moved the view: stop fitting the graph on every update
    this.cy.on('dragpan scrollzoom pinchzoom', () => { this.autoFit = false; });
    // the detail panel opening or the window resizing changes the container's size
    new ResizeObserver(() => {
      this.cy.resize();
      if (this.autoFit) this.fit();
    }).observe(container);
    // cytoscape caches where its container is on the screen and maps every pointer event
    // through it; content filling in above the graph moves the container without resizing
    // it, and clicks then landed beside their node. Before cytoscape sees a pointer event
    // (capture phase), tell it the container moved, if it did.
    let placed = null;
    const recheck = () => {
      const { left, top } = container.getBoundingClientRect();
      if (!placed || placed.left !== left || placed.top !== top) this.cy.resize();
      placed = { left, top };
    };
    for (const type of ['mouseover', 'mousemove', 'mousedown', 'touchstart', 'wheel']) {
      container.addEventListener(type, recheck, { capture: true, passive: true });
    }
  }

  render(model) {
    const { cy } = this;
    const selected = cy.$('node:selected').id();
    const viewport = { zoom: cy.zoom(), pan: { ...cy.pan() } };
    cy.batch(() => {
      cy.elements().remove();
      cy.add(model.elements);
    });
    cy.elements('.lineage').layout(LAYOUT).run();
    this.placeMarkers(model);
    if (selected && cy.getElementById(selected).nonempty()) cy.getElementById(selected).select();
    if (this.autoFit) this.fit();
    else cy.viewport(viewport);
    this.model = model;
    this.version += 1;
    const ds = this.container.dataset;
    ds.run = model.snapshot.run;
    ds.version = String(this.version);
    ds.total = String(model.snapshot.total);
    ds.visible = String(model.shown.length);
    ds.lastGood = String(model.snapshot.lastGoodId ?? '');
    ds.state = 'ready';
  }

  placeMarkers(model) {
    const { cy } = this;
    const shown = cy.nodes('.checkpoint, .group');
    if (!shown.length || !model.markers.length) return;
    const bb = shown.boundingBox({ includeLabels: true });
    const y = bb.y1 - 34;
    const points = [...new Map(shown.map((n) => [n.data('step'), n.position('x')])).entries()].sort((a, b) => a[0] - b[0]);
    // labels sit right of their marker; a marker whose label would overlap goes one row up
    const rows = [];
    const placed = model.markers.map((m) => ({ m, x: stepToX(points, m.step) })).sort((a, b) => a.x - b.x);
    const add = [];
    for (const { m, x } of placed) {
      const span = [x - 9, x + 14 + 5.5 * m.label.length];
      let row = 0;
      while (rows[row] && rows[row].some(([a, b]) => span[0] < b + 6 && span[1] > a - 6)) row += 1;
      (rows[row] ||= []).push(span);
      add.push({ group: 'nodes', data: { id: m.key, label: m.label, checkpointId: m.checkpointId, step: m.step },
        classes: `marker m-${m.kind}`, position: { x, y: y - row * 22 } });
      if (m.target && cy.getElementById(m.target).nonempty()) {
        add.push({ group: 'edges', data: { id: `${m.key}-link`, source: m.key, target: m.target }, classes: 'marker-link' });
      }
    }
    add.push({ group: 'nodes', data: { id: 'axis-a' }, classes: 'axis', position: { x: bb.x1 - 10, y } });
    add.push({ group: 'nodes', data: { id: 'axis-b' }, classes: 'axis', position: { x: bb.x2 + 10, y } });
    add.push({ group: 'edges', data: { id: 'axis', source: 'axis-a', target: 'axis-b' }, classes: 'axis' });
    cy.add(add);
    cy.elements('.axis').lock();
    cy.nodes('.marker').lock();
  }

  /** The whole graph, unless that makes labels unreadable: then its newest part, legibly. */
  fit() {
    this.autoFit = true;
    const { cy } = this;
    const all = cy.elements(':visible');
    cy.fit(all, 24);
    if (cy.zoom() >= MIN_FIT_ZOOM) return;
    const bb = all.boundingBox();
    cy.zoom(MIN_FIT_ZOOM);
    cy.pan({ x: cy.width() - 24 - bb.x2 * MIN_FIT_ZOOM, y: cy.height() / 2 - ((bb.y1 + bb.y2) / 2) * MIN_FIT_ZOOM });
  }

  zoomBy(factor) {
    this.autoFit = false;
    const { cy } = this;
    cy.zoom({ level: cy.zoom() * factor, renderedPosition: { x: cy.width() / 2, y: cy.height() / 2 } });
  }

  select(key) {
    const { cy } = this;
    cy.$(':selected').unselect();
    if (!key) return;
    const el = cy.getElementById(key);
    if (el.nonempty()) el.select();
  }

  /** Checkpoint ids GC would delete: marked while the GC view is open. */
  markDoomed(ids) {
    const { cy } = this;
    cy.nodes('.doomed').removeClass('doomed');
    if (!this.model || !ids) return;
    for (const id of ids) {
      const key = this.model.keyOf(id);
      cy.getElementById(key).addClass('doomed');
    }
  }

  doomedKeys() {
    return this.cy.nodes('.doomed').map((n) => n.id());
  }

  /** The shape an element is drawn with (a cytoscape shape name). */
  shape(key) {
    const el = this.cy.getElementById(key);
    return el.nonempty() ? el.style('shape') : null;
  }

  /** Where an element is drawn, in CSS pixels from the graph container's top left corner. */
  renderedPosition(key) {
    const el = this.cy.getElementById(key);
    return el.nonempty() ? el.renderedPosition() : null;
  }
}
