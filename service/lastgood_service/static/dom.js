// DOM helpers. Every user-controlled string (run names, tags, event data) reaches the page as
// a text node or an attribute value set through the DOM, never as markup: nothing here (or
// anywhere in the page) uses innerHTML, outerHTML, insertAdjacentHTML or document.write.

/** h('td', {class: 'num', title: iso}, 'text', childNode, ...) -> an element. */
export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === 'class') el.className = value;
    else if (key === 'dataset') Object.assign(el.dataset, value);
    else if (key.startsWith('on')) el.addEventListener(key.slice(2), value);
    else if (value === true) el.setAttribute(key, '');
    else el.setAttribute(key, String(value));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children) {
    if (child === undefined || child === null || child === false) continue;
    if (Array.isArray(child)) append(el, child);
    else el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

/** Replace an element's children (text or nodes). */
export function fill(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

export function show(el, visible) {
  el.hidden = !visible;
}

const UNITS = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];

export function formatBytes(n) {
  if (n === null || n === undefined) return '–';
  let v = Number(n);
  let i = 0;
  while (v >= 1024 && i < UNITS.length - 1) {
    v /= 1024;
    i += 1;
  }
  return `${i === 0 ? v : v.toFixed(v < 10 ? 1 : 0)} ${UNITS[i]}`;
}

export function formatSeconds(s) {
  if (s === null || s === undefined) return '–';
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 120) return `${s.toFixed(s < 10 ? 2 : 1)} s`;
  return `${Math.round(s / 60)} min`;
}

export function formatAgo(iso, now = Date.now()) {
  if (!iso) return '–';
  const t = Date.parse(iso);
  if (Number.isNaN(t)) return iso;
  const s = Math.max(0, (now - t) / 1000);
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${Math.round(s / 3600)} h ago`;
  return new Date(t).toISOString().slice(0, 16).replace('T', ' ');
}

export function formatNumber(n) {
  return Number(n).toLocaleString('en-US');
}

/** Cut a string for a graph label (the full text is in the detail panel). */
export function clip(s, n = 24) {
  const str = String(s);
  return str.length > n ? `${str.slice(0, n - 1)}…` : str;
}
