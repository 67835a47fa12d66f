// The lineage graph's drawing: cytoscape's style for every element class graph.js makes,
// and the dagre layout's options. The legend (index.html, app.css) draws the same glyphs.

const COLOURS = {
  committed: '#2e9d57', pending: '#f2a900', abandoned: '#9aa0a6', corrupt: '#d93025', suspect: '#e8710a', deleted: '#ffffff',
};

export const STYLE = [
  { selector: 'node', style: {
    label: 'data(label)', 'font-size': 10, 'font-family': 'system-ui, sans-serif', color: '#202124',
    'text-wrap': 'wrap', 'text-max-width': 84, 'text-valign': 'bottom', 'text-margin-y': 4,
    'text-background-color': '#ffffff', 'text-background-opacity': 0.8, 'text-background-padding': 1,
    width: 22, height: 22, 'border-width': 1.5, 'border-color': '#5f6368',
  } },
  { selector: '.vroot', style: { visibility: 'hidden', width: 1, height: 1, label: '' } },
  { selector: 'node.st-committed', style: { 'background-color': COLOURS.committed, 'border-color': '#1e6b3a' } },
  { selector: 'node.st-pending', style: { 'background-color': COLOURS.pending, 'border-style': 'dashed', 'border-color': '#8a6100', 'border-width': 2 } },
  // a memory checkpoint (docs/memory-tier.md): a hexagon; a status with its own shape
  // (abandoned, corrupt, suspect) keeps it, as that is the warning
  { selector: 'node.tier-memory', style: { shape: 'hexagon' } },
  { selector: 'node.st-abandoned', style: { 'background-color': COLOURS.abandoned, shape: 'ellipse', 'border-color': '#5f6368' } },
  { selector: 'node.st-corrupt', style: { 'background-color': COLOURS.corrupt, shape: 'octagon', 'border-color': '#8c1d18' } },
  { selector: 'node.st-suspect', style: { 'background-color': COLOURS.suspect, shape: 'round-diamond', 'border-color': '#8a4200' } },
  { selector: 'node.st-deleted', style: { 'background-color': COLOURS.deleted, 'border-style': 'dotted', 'border-color': '#80868b', 'border-width': 2 } },
  { selector: 'node.group', style: { shape: 'round-rectangle', width: 56, height: 12, 'background-opacity': 0.55 } },
  { selector: 'node.last-good', style: {
    width: 32, height: 32, 'border-width': 5, 'border-style': 'double', 'border-color': '#1a73e8', 'font-weight': 'bold',
    'underlay-color': '#1a73e8', 'underlay-opacity': 0.18, 'underlay-padding': 7, 'underlay-shape': 'ellipse',
  } },
  { selector: 'node.doomed', style: { 'overlay-color': '#d93025', 'overlay-opacity': 0.25, 'overlay-padding': 4 } },
  { selector: 'node:selected', style: { 'overlay-color': '#1a73e8', 'overlay-opacity': 0.3, 'overlay-padding': 6 } },
  { selector: 'edge', style: {
    width: 1.5, 'line-color': '#9aa0a6', 'curve-style': 'taxi', 'taxi-direction': 'rightward', 'taxi-turn': 18,
    'target-arrow-shape': 'triangle', 'target-arrow-color': '#9aa0a6', 'arrow-scale': 0.8,
  } },
  { selector: 'edge.faint', style: { 'line-style': 'dashed' } },
  { selector: 'edge.gap', style: {
    'line-color': '#d93025', 'target-arrow-color': '#d93025', 'line-style': 'dashed', 'line-dash-pattern': [3, 3], width: 2,
    label: 'data(label)', 'font-size': 9, color: '#a50e0e', 'text-background-color': '#ffffff', 'text-background-opacity': 0.9,
    'text-margin-y': -10, 'text-margin-x': -6,
  } },
  { selector: 'edge.vroot', style: { visibility: 'hidden' } },
  { selector: 'node.marker', style: {
    shape: 'diamond', width: 14, height: 14, 'border-width': 1, 'font-size': 9, 'text-valign': 'center',
    'text-halign': 'right', 'text-margin-x': 4, 'text-background-opacity': 0,
  } },
  { selector: 'node.m-spike', style: { 'background-color': '#d93025', 'border-color': '#8c1d18' } },
  { selector: 'node.m-rollback', style: { 'background-color': '#9334e6', 'border-color': '#5b1f8f' } },
  { selector: 'node.m-restart', style: { 'background-color': '#1a73e8', 'border-color': '#0b4a9e', shape: 'round-triangle' } },
  { selector: 'node.m-fenced', style: { 'background-color': '#e37400', 'border-color': '#9a4f00', shape: 'round-rectangle' } },
  { selector: 'node.m-corrupt', style: { 'background-color': '#8c1d18', 'border-color': '#5a0f0b', shape: 'octagon' } },
  { selector: 'node.m-save_given_up', style: { 'background-color': '#f28b82', 'border-color': '#a50e0e', shape: 'vee' } },
  { selector: 'edge.marker-link', style: {
    width: 1, 'line-style': 'dotted', 'line-color': '#bdc1c6', 'target-arrow-shape': 'none', 'curve-style': 'straight',
  } },
  { selector: 'node.axis', style: { width: 1, height: 1, 'background-opacity': 0, 'border-width': 0, label: '' } },
  { selector: 'edge.axis', style: {
    width: 1, 'line-color': '#dadce0', 'target-arrow-shape': 'none', 'curve-style': 'straight',
    'font-size': 9, color: '#80868b', 'source-label': 'events', 'source-text-offset': 22, 'source-text-margin-y': -8,
  } },
];

/** Below this zoom labels are unreadable: fitting stops there and shows the newest part. */
export const MIN_FIT_ZOOM = 0.55;

export const LAYOUT = {
  name: 'dagre', rankDir: 'LR', nodeSep: 14, rankSep: 18, edgeSep: 8, nodeDimensionsIncludeLabels: true,
  minLen: (edge) => edge.data('minLen') || 1, fit: false, animate: false,
};
