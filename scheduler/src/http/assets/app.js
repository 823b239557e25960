// floe admin dashboard: a hash-routed single page that polls the JSON API of docs/HTTP_API.md.
// Every server string reaches the page through textContent or setAttribute, never innerHTML.
'use strict';

const POLL_MS = 2000;
const TOKEN_KEY = 'floe-token';
const JOBS_PER_PAGE = 50;
const NODES_PER_PAGE = 100;
const MAX_EVENT_ROWS = 2000;
const JOB_STATES = ['pending', 'running', 'succeeded', 'failed', 'cancelled'];
const ACTIVE_JOB_STATES = ['pending', 'running'];

// ---------- formatting ----------

const DASH = '—';

function isNum(v) {
  return typeof v === 'number' && Number.isFinite(v);
}

function fmtBytes(n) {
  if (!isNum(n)) return DASH;
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];
  let value = Math.abs(n);
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  const sign = n < 0 ? '-' : '';
  if (unit === 0) return `${sign}${value} B`;
  const digits = value < 10 ? 2 : value < 100 ? 1 : 0;
  return `${sign}${value.toFixed(digits)} ${units[unit]}`;
}

function fmtCount(n) {
  if (!isNum(n)) return DASH;
  if (Math.abs(n) >= 1e9) return `${(n / 1e9).toFixed(2)} G`;
  if (Math.abs(n) >= 1e7) return `${(n / 1e6).toFixed(1)} M`;
  return Math.round(n).toLocaleString('en-US');
}

function fmtRate(n) {
  if (!isNum(n)) return DASH;
  if (n === 0) return '0/s';
  if (n < 1000) return `${n.toFixed(n < 10 ? 1 : 0)}/s`;
  if (n < 1e6) return `${(n / 1e3).toFixed(n < 1e4 ? 2 : n < 1e5 ? 1 : 0)} k/s`;
  if (n < 1e9) return `${(n / 1e6).toFixed(2)} M/s`;
  return `${(n / 1e9).toFixed(2)} G/s`;
}

function fmtBytesRate(n) {
  return isNum(n) ? `${fmtBytes(Math.round(n))}/s` : DASH;
}

// Axis labels read better without trailing zeros: "7.50 GiB" -> "7.5 GiB", "10.0 k/s" -> "10 k/s".
function trimZeros(text) {
  return text.replace(/(\.\d*?)0+(?=\D|$)/, '$1').replace(/\.(?=\D|$)/, '');
}

function fmtDuration(ms) {
  if (!isNum(ms)) return DASH;
  if (ms < 1000) return `${Math.round(ms)} ms`;
  const s = ms / 1000;
  if (s < 60) return `${s.toFixed(s < 10 ? 2 : 1)} s`;
  const totalS = Math.round(s);
  const h = Math.floor(totalS / 3600);
  const m = Math.floor((totalS % 3600) / 60);
  const sec = totalS % 60;
  if (h > 0) return `${h} h ${String(m).padStart(2, '0')} m`;
  return `${m} m ${String(sec).padStart(2, '0')} s`;
}

function pad2(n) {
  return String(n).padStart(2, '0');
}

function fmtClock(ms) {
  const d = new Date(ms);
  return `${pad2(d.getHours())}:${pad2(d.getMinutes())}:${pad2(d.getSeconds())}`;
}

function fmtTime(ms) {
  if (!isNum(ms)) return DASH;
  const d = new Date(ms);
  const now = new Date();
  const sameDay = d.toDateString() === now.toDateString();
  if (sameDay) return fmtClock(ms);
  return `${d.getFullYear()}-${pad2(d.getMonth() + 1)}-${pad2(d.getDate())} ${fmtClock(ms)}`;
}

function fmtAgo(ms) {
  if (!isNum(ms)) return DASH;
  const age = Date.now() - ms;
  if (age < 0) return 'just now';
  return `${fmtDuration(age)} ago`;
}

function fmtPercent(part, whole) {
  if (!isNum(part) || !isNum(whole) || whole <= 0) return DASH;
  const p = (100 * part) / whole;
  return `${p < 10 ? p.toFixed(1) : Math.round(p)}%`;
}

function truncate(text, max) {
  const s = String(text);
  return s.length > max ? `${s.slice(0, max - 1)}…` : s;
}

function textOf(v) {
  if (v === null || v === undefined) return DASH;
  if (typeof v === 'object') return JSON.stringify(v);
  return String(v);
}

// ---------- DOM helpers ----------

// el('td', {class: 'num', title: x}, child, ...): children are nodes or text (set as text nodes).
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  if (attrs) {
    for (const [key, value] of Object.entries(attrs)) {
      if (value === null || value === undefined || value === false) continue;
      if (key.startsWith('on')) node.addEventListener(key.slice(2), value);
      else if (key === 'dataset') Object.assign(node.dataset, value);
      else if (key === 'style') node.style.cssText = value;
      else node.setAttribute(key, value === true ? '' : String(value));
    }
  }
  append(node, children);
  return node;
}

function append(node, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function setChildren(node, ...children) {
  node.replaceChildren();
  return append(node, children);
}

// Replaces a container's content only when the data it shows changed, so an unchanged section
// keeps its scroll position and any text the user selected.
const shownData = new WeakMap();

function patch(node, data, build) {
  const sig = JSON.stringify(data);
  if (shownData.get(node) === sig) return;
  shownData.set(node, sig);
  setChildren(node, build());
}

// Keyed update of a table body: rows whose data did not change stay the same DOM nodes.
function syncRows(tbody, items, keyOf, buildRow) {
  const existing = new Map();
  for (const row of Array.from(tbody.rows)) existing.set(row.dataset.key, row);
  let previous = null;
  for (const item of items) {
    const key = String(keyOf(item));
    const sig = JSON.stringify(item);
    let row = existing.get(key);
    existing.delete(key);
    if (!row || shownData.get(row) !== sig) {
      const fresh = buildRow(item);
      fresh.dataset.key = key;
      shownData.set(fresh, sig);
      if (row) row.replaceWith(fresh);
      row = fresh;
    }
    const wanted = previous ? previous.nextSibling : tbody.firstChild;
    if (wanted !== row) tbody.insertBefore(row, wanted);
    previous = row;
  }
  for (const stale of existing.values()) stale.remove();
}

function badge(state, text) {
  return el('span', { class: `badge st-${state}` }, text === undefined ? state : text);
}

function num(text, attrs) {
  return el('td', Object.assign({ class: 'num' }, attrs || {}), text);
}

function bar(fraction, kind, title) {
  const pct = isNum(fraction) ? Math.max(0, Math.min(1, fraction)) * 100 : 0;
  return el(
    'div',
    { class: `bar ${kind || ''}`, title },
    el('div', { class: 'fill', style: `width:${pct.toFixed(1)}%` }),
  );
}

function table(id, headers) {
  const tbody = el('tbody');
  const t = el(
    'table',
    { id, class: 'grid' },
    el('thead', null, el('tr', null, headers.map((h) => {
      const [label, cls] = Array.isArray(h) ? h : [h, null];
      return el('th', { class: cls }, label);
    }))),
    tbody,
  );
  return { table: t, tbody };
}

function section(title, ...children) {
  return el('section', { class: 'card' }, title ? el('h2', null, title) : null, children);
}

// What the leader leases jobs' drivers: a job's leases per node (`by` 'node') or a node's per
// job (`by` 'job'), from the leader's last report.
function leaseSection(leases, by) {
  if (!leases || leases.length === 0) {
    return section('Leases', el('p', { class: 'empty', id: 'leases-none' },
      by === 'node' ? 'The job holds no leases.' : 'No job holds a lease on this node.'));
  }
  const link = (id) => el('a', { href: by === 'node' ? `#/nodes/${encodeURIComponent(id)}` : `#/jobs/${encodeURIComponent(id)}` }, id);
  return section('Leases', el('table', { class: 'grid', id: 'leases' },
    el('thead', null, el('tr', null, el('th', null, by), el('th', { class: 'num' }, 'leases'),
      el('th', { class: 'num' }, 'recalled'), el('th', { class: 'num' }, 'cpus'), el('th', { class: 'num' }, 'heap'))),
    el('tbody', null, leases.map((lease) => el('tr', { dataset: { lease: lease[by] } },
      el('td', { class: 'mono' }, link(lease[by])), num(textOf(lease.leases)), num(textOf(lease.recalled)),
      num(textOf(lease.cpus)), num(fmtBytes(lease.heap_bytes)))))));
}

// ---------- API ----------

class ApiError extends Error {
  constructor(message, status) {
    super(message);
    this.status = status;
  }
}

async function readError(res) {
  try {
    const body = await res.json();
    if (body && typeof body.error === 'string') return body.error;
  } catch (_) {
    // Not JSON: fall through to the status line.
  }
  return `${res.status} ${res.statusText}`;
}

// GETs with the tab's token when one is set (reads need a `read` token unless the cluster
// serves them publicly).
async function api(path) {
  const headers = { Accept: 'application/json' };
  const bearer = token();
  if (bearer) headers.Authorization = `Bearer ${bearer}`;
  let res;
  try {
    res = await fetch(path, { cache: 'no-store', headers });
  } catch (e) {
    throw new ApiError(`cannot reach this replica (${path}): ${e.message}`, 0);
  }
  if (res.status === 401) {
    throw new ApiError(
      `${path}: this cluster needs a token with the read scope: click "token" at the top ` +
        `to set one (${await readError(res)})`,
      401,
    );
  }
  if (!res.ok) throw new ApiError(`${path}: ${await readError(res)}`, res.status);
  return res.json();
}

function token() {
  return sessionStorage.getItem(TOKEN_KEY);
}

function askToken() {
  const given = prompt(
    'Client token (from `floe token create`; read to browse, submit to cancel jobs, admin to clean the cache):',
    '',
  );
  if (given === null || given.trim() === '') return null;
  sessionStorage.setItem(TOKEN_KEY, given.trim());
  showTokenState();
  return given.trim();
}

// POSTs with the tab's token, asking for it the first time. Returns null if the user gave none.
async function mutate(path, body) {
  const bearer = token() || askToken();
  if (!bearer) return null;
  let res;
  try {
    res = await fetch(path, {
      method: 'POST',
      cache: 'no-store',
      headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${bearer}` },
      body: JSON.stringify(body),
    });
  } catch (e) {
    throw new ApiError(`cannot reach this replica (${path}): ${e.message}`, 0);
  }
  if (res.status === 401) {
    sessionStorage.removeItem(TOKEN_KEY);
    showTokenState();
    throw new ApiError(
      'The token was rejected (401), so nothing changed. It has been cleared: ' +
        'you will be asked for it again on the next try.',
      401,
    );
  }
  if (!res.ok) throw new ApiError(`${path}: ${await readError(res)}`, res.status);
  return res.json();
}

async function runAction(action) {
  try {
    const message = await action();
    if (message) flash(message, false);
  } catch (e) {
    flash(e.message, true);
  }
  refresh();
}

// ---------- chrome: header, banner, flash ----------

let flashTimer = null;

function flash(message, isError) {
  const box = document.getElementById('flash');
  box.textContent = message;
  box.className = `banner ${isError ? 'error' : 'ok'}`;
  box.hidden = false;
  clearTimeout(flashTimer);
  flashTimer = setTimeout(() => {
    box.hidden = true;
  }, isError ? 12000 : 5000);
}

function showBanner(message) {
  const box = document.getElementById('banner');
  box.textContent = `${message} — retrying every ${POLL_MS / 1000} s.`;
  box.hidden = false;
}

function clearBanner() {
  document.getElementById('banner').hidden = true;
}

function showTokenState() {
  const link = document.getElementById('token-link');
  link.textContent = token() ? 'token ✓' : 'token';
}

function onTokenLink(event) {
  event.preventDefault();
  if (token()) {
    if (confirm('A token is set for this tab. Clear it?')) {
      sessionStorage.removeItem(TOKEN_KEY);
      showTokenState();
      flash('Token cleared.', false);
    }
  } else if (askToken()) {
    flash('Token kept for this tab.', false);
  }
}

function renderHeader(cluster, page) {
  const health = document.getElementById('health');
  health.hidden = false;
  health.className = `badge st-${cluster.health}`;
  health.textContent = cluster.health;
  const leader = cluster.leader === null || cluster.leader === undefined
    ? el('span', { class: 'bad' }, 'no leader')
    : `leader ${cluster.leader}`;
  setChildren(document.getElementById('replica-info'), `replica ${cluster.replica_id} · `, leader);
  document.getElementById('updated').textContent = `updated ${fmtClock(Date.now())}`;
  for (const link of document.querySelectorAll('#nav a')) {
    link.classList.toggle('current', link.dataset.page === page);
  }
}

// ---------- routing ----------

// A hand-typed hash may hold a malformed escape; keep its text rather than fail the page.
function safeDecode(text) {
  try {
    return decodeURIComponent(text);
  } catch (_) {
    return text;
  }
}

// '#/jobs/12?x=y' -> {page: 'job', id: '12', query: URLSearchParams}
function parseRoute() {
  const raw = location.hash.replace(/^#\/?/, '');
  const [path, queryText] = raw.split('?');
  const parts = path.split('/').filter(Boolean).map(safeDecode);
  const query = new URLSearchParams(queryText || '');
  if (parts.length === 0 || parts[0] === 'overview') return { page: 'overview', query };
  if (parts[0] === 'jobs' && parts.length === 2) return { page: 'job', id: parts[1], query };
  if (parts[0] === 'nodes' && parts.length === 2) return { page: 'node', id: parts[1], query };
  if (parts.length === 1 && ['nodes', 'jobs', 'actors', 'cache', 'events', 'logs'].includes(parts[0])) {
    return { page: parts[0], query };
  }
  return { page: 'notfound', query };
}

function navPage(route) {
  if (route.page === 'job') return 'jobs';
  if (route.page === 'node') return 'nodes';
  return route.page;
}

// A list page's hash with its filter and offset, leaving out the defaults.
function hashFor(page, params) {
  const query = new URLSearchParams();
  for (const [key, value] of Object.entries(params)) {
    if (value !== '' && value !== 0 && value !== null && value !== undefined) query.set(key, value);
  }
  const text = query.toString();
  return `#/${page}${text ? `?${text}` : ''}`;
}

// Points the nav link at the current filter and offset, so going back to the page keeps them.
function rememberNav(route) {
  const link = document.querySelector(`#nav a[data-page="${route.page}"]`);
  if (link && route.page !== 'overview') link.setAttribute('href', location.hash || `#/${route.page}`);
}

function offsetParam(query) {
  const n = parseInt(query.get('offset') || '0', 10);
  return Number.isFinite(n) && n > 0 ? n : 0;
}

function pager(offset, limit, shown, total, go) {
  const first = total === 0 ? 0 : offset + 1;
  const last = offset + shown;
  return el(
    'div',
    { class: 'pager' },
    el('button', { type: 'button', disabled: offset <= 0, onclick: () => go(Math.max(0, offset - limit)) }, '‹ prev'),
    el('span', { class: 'muted' }, `showing ${fmtCount(first)}–${fmtCount(last)} of ${fmtCount(total)}`),
    el('button', { type: 'button', disabled: offset + limit >= total, onclick: () => go(offset + limit) }, 'next ›'),
  );
}

function filterButtons(options, current, go) {
  return el('div', { class: 'filters' }, options.map(([value, label]) =>
    el('button', {
      type: 'button',
      class: value === current ? 'selected' : null,
      onclick: () => go(value),
    }, label)));
}

// ---------- charts ----------

function niceCeil(value, base) {
  if (!(value > 0)) return 1;
  let unit = 1;
  if (base === 1024) {
    while (value / unit >= 1024) unit *= 1024;
  }
  const scaled = value / unit;
  const magnitude = 10 ** Math.floor(Math.log10(scaled));
  const step = [1, 2, 2.5, 5, 10].find((m) => m * magnitude >= scaled) * magnitude;
  return step * unit;
}

const SVG_NS = 'http://www.w3.org/2000/svg';

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

// A line chart of points [{t, v}] (v may be null: a gap), y from 0 to a rounded maximum.
function lineChart(points, { width, height = 180, format, base = 10, cls = '' }) {
  const pad = { left: 70, right: 12, top: 10, bottom: 24 };
  const chart = svg('svg', { width, height, class: `chart ${cls}`, role: 'img' });
  const plotW = width - pad.left - pad.right;
  const plotH = height - pad.top - pad.bottom;
  const values = points.filter((p) => isNum(p.v));
  if (values.length === 0 || plotW <= 0) {
    chart.append(svg('text', { x: width / 2, y: height / 2, class: 'empty', 'text-anchor': 'middle' }, 'no samples yet'));
    return chart;
  }
  const t0 = points[0].t;
  const t1 = Math.max(points[points.length - 1].t, t0 + 1);
  const yMax = niceCeil(Math.max(...values.map((p) => p.v)), base);
  const x = (t) => pad.left + ((t - t0) / (t1 - t0)) * plotW;
  const y = (v) => pad.top + plotH - (v / yMax) * plotH;
  for (let i = 0; i <= 4; i += 1) {
    const v = (yMax * i) / 4;
    chart.append(svg('line', { x1: pad.left, x2: width - pad.right, y1: y(v), y2: y(v), class: 'gridline' }));
    chart.append(svg('text', { x: pad.left - 6, y: y(v) + 4, 'text-anchor': 'end', class: 'axis' }, trimZeros(format(v))));
  }
  for (const [t, anchor] of [[t0, 'start'], [(t0 + t1) / 2, 'middle'], [t1, 'end']]) {
    chart.append(svg('text', { x: x(t), y: height - 6, 'text-anchor': anchor, class: 'axis' }, fmtClock(t)));
  }
  // One path per run of non-null values; the area under each run is shaded.
  let line = '';
  let area = '';
  let run = [];
  const flush = () => {
    if (run.length === 0) return;
    const coords = run.map((p) => `${x(p.t).toFixed(1)},${y(p.v).toFixed(1)}`);
    line += `M${coords.join('L')}`;
    area += `M${x(run[0].t).toFixed(1)},${y(0)}L${coords.join('L')}L${x(run[run.length - 1].t).toFixed(1)},${y(0)}Z`;
    run = [];
  };
  for (const p of points) {
    if (isNum(p.v)) run.push(p);
    else flush();
  }
  flush();
  chart.append(svg('path', { d: area, class: 'area' }));
  chart.append(svg('path', { d: line, class: 'line' }));
  const lastPoint = values[values.length - 1];
  chart.append(svg('circle', { cx: x(lastPoint.t), cy: y(lastPoint.v), r: 3, class: 'dot' }));
  return chart;
}

function chartCard(title) {
  const now = el('span', { class: 'muted' });
  const holder = el('div', { class: 'chart-holder' });
  const card = section(null, el('div', { class: 'chart-title' }, el('h2', null, title), now), holder);
  return { card, now, holder };
}

// Draws into a chart card that is already in the document, so its width is known.
function drawChart(chart, samples, valueOf, format, base) {
  const points = samples.map((s) => ({ t: s.time_ms, v: valueOf(s) }));
  chart.now.textContent = `now ${format(points.length ? points[points.length - 1].v : null)}`;
  const width = Math.max(260, chart.holder.clientWidth || 500);
  setChildren(chart.holder, lineChart(points, { width, format, base }));
}

// ---------- pages ----------
// Each page: mount(main, route) builds the skeleton once; load(route) fetches; render(data, cluster, route).

const pages = {};

pages.overview = {
  mount(main) {
    this.top = el('div');
    this.tiles = el('div', { class: 'tiles' });
    this.raft = el('div');
    this.storeChart = chartCard('Object store used');
    this.rateChart = chartCard('Output rows/s');
    this.tasksChart = chartCard('Tasks running');
    this.spillChart = chartCard('Spilled');
    this.networkChart = chartCard('Network (bytes received/s)');
    this.span = el('div');
    this.charts = el('div', { class: 'charts' }, this.tasksChart.card, this.rateChart.card,
      this.spillChart.card, this.networkChart.card, this.storeChart.card);
    setChildren(main, this.top, this.tiles, section('Raft replicas', this.raft), this.span, this.charts);
    this.chartWidth = 0;
    this.lastSample = undefined;
  },
  minutes(route) {
    return route.query.get('minutes') === '60' ? 60 : 10;
  },
  load(route) {
    return api(`/api/history?minutes=${this.minutes(route)}`);
  },
  render(history, cluster, route) {
    const minutes = this.minutes(route);
    patch(this.span, minutes, () => filterButtons([[10, 'last 10 minutes'], [60, 'last hour']], minutes,
      (value) => { location.hash = hashFor('overview', { minutes: value === 10 ? '' : value }); }));
    patch(this.top, [cluster.health, cluster.leader, cluster.as_of_index, cluster.replica_id], () =>
      el('div', { class: 'overview-head' },
        el('span', { class: `badge big st-${cluster.health}` }, cluster.health),
        el('span', null, healthText(cluster)),
        el('span', { class: 'muted' }, `replica ${cluster.replica_id} has applied up to index ${fmtCount(cluster.as_of_index)}`)));

    const store = cluster.object_store || {};
    const nodes = cluster.nodes || {};
    const jobs = cluster.jobs || {};
    patch(this.tiles, [store, nodes, jobs, cluster.spilled_bytes, cluster.fallback_bytes], () => [
      tile('nodes alive', fmtCount(nodes.alive), 'alive', '#/nodes?state=alive'),
      tile('nodes dead', fmtCount(nodes.dead), nodes.dead > 0 ? 'dead' : null, '#/nodes?state=dead'),
      tile('jobs running', fmtCount(jobs.running), 'running', '#/jobs?state=running'),
      tile('jobs pending', fmtCount(jobs.pending), 'pending', '#/jobs?state=pending'),
      tile('jobs failed', fmtCount(jobs.failed), jobs.failed > 0 ? 'failed' : null, '#/jobs?state=failed'),
      el('div', { class: 'tile wide' },
        el('div', { class: 'tile-label' }, 'object store used'),
        el('div', { class: 'tile-value' }, fmtBytes(store.used_bytes),
          el('span', { class: 'muted small' }, ` of ${fmtBytes(store.capacity_bytes)} (${fmtPercent(store.used_bytes, store.capacity_bytes)})`)),
        bar(store.capacity_bytes > 0 ? store.used_bytes / store.capacity_bytes : 0, 'store')),
      el('div', { class: 'tile' },
        el('div', { class: 'tile-label' }, 'spilled'),
        el('div', { class: 'tile-value' }, fmtBytes(cluster.spilled_bytes)),
        el('div', { class: 'muted small' }, `fallback ${fmtBytes(cluster.fallback_bytes)}`)),
    ]);

    patch(this.raft, [cluster.replicas, cluster.leader, cluster.replica_id], () => {
      const { table: t, tbody } = table('raft-table', ['id', 'addr', 'role', 'reachable',
        ['term', 'num'], ['commit', 'num'], ['applied', 'num'], 'sees leader']);
      for (const r of cluster.replicas || []) {
        const isLeader = cluster.leader !== null && r.id === cluster.leader;
        tbody.append(el('tr', { class: r.id === cluster.replica_id ? 'self' : null },
          el('td', null, String(r.id), r.id === cluster.replica_id ? el('span', { class: 'muted small' }, ' (serving)') : null),
          el('td', { class: 'mono' }, textOf(r.addr)),
          el('td', null, isLeader ? badge('leader', 'leader') : el('span', { class: 'muted' }, 'follower')),
          el('td', null, r.reachable ? badge('ok', 'yes') : badge('failed', 'no')),
          num(fmtCount(r.term)), num(fmtCount(r.commit)), num(fmtCount(r.applied)),
          el('td', null, textOf(r.leader))));
      }
      return t;
    });

    const samples = (history && history.samples) || [];
    const width = this.charts.clientWidth;
    const last = samples.length ? samples[samples.length - 1].time_ms : null;
    // Redraw when a new sample arrived or the window was resized.
    if (last !== this.lastSample || width !== this.chartWidth || samples.length !== this.sampleCount) {
      this.lastSample = last;
      this.chartWidth = width;
      this.sampleCount = samples.length;
      drawChart(this.storeChart, samples, (s) => s.object_store_used_bytes, fmtBytes, 1024);
      drawChart(this.rateChart, samples, (s) => s.rows_per_s, fmtRate, 10);
      drawChart(this.tasksChart, samples, (s) => s.tasks_running, fmtCount, 10);
      drawChart(this.spillChart, samples, (s) => s.spilled_bytes, fmtBytes, 1024);
      drawChart(this.networkChart, samples, (s) => s.network_bytes_per_s, fmtBytesRate, 1024);
    }
  },
};

function healthText(cluster) {
  if (cluster.health === 'ok') return 'a leader is elected and every alive node is heartbeating';
  if (cluster.health === 'degraded') return 'a replica is unreachable or a node is late';
  if (cluster.health === 'down') return 'no leader: the cluster cannot accept changes';
  return '';
}

function tile(label, value, state, href) {
  return el('a', { class: `tile ${state ? `tile-${state}` : ''}`, href },
    el('div', { class: 'tile-label' }, label),
    el('div', { class: 'tile-value' }, value));
}

pages.nodes = {
  mount(main) {
    this.filters = el('div');
    this.pagerTop = el('div');
    this.pagerBottom = el('div');
    const { table: t, tbody } = table('nodes-table', ['id', 'addr', 'state', ['cpus', 'num'], 'memory',
      ['store used', 'num'], ['spilled', 'num'], ['workers', 'num'], ['heartbeat', 'num'], 'dead reason']);
    this.tbody = tbody;
    this.empty = el('p', { class: 'empty', hidden: true }, 'no nodes');
    this.shared = el('div');
    setChildren(main, section('Nodes', el('div', { class: 'toolbar' }, this.filters, this.pagerTop), this.shared, t, this.empty, this.pagerBottom));
  },
  params(route) {
    const state = route.query.get('state');
    return { state: state === 'alive' || state === 'dead' ? state : '', offset: offsetParam(route.query) };
  },
  load(route) {
    const { state, offset } = this.params(route);
    const q = new URLSearchParams({ offset, limit: NODES_PER_PAGE });
    if (state) q.set('state', state);
    return api(`/api/nodes?${q}`);
  },
  render(data, cluster, route) {
    const { state, offset } = this.params(route);
    const go = (params) => { location.hash = hashFor('nodes', Object.assign({ state, offset }, params)); };
    if (offset > 0 && offset >= data.total) {
      go({ offset: Math.max(0, Math.floor((data.total - 1) / NODES_PER_PAGE) * NODES_PER_PAGE) });
      return;
    }
    const counts = cluster.nodes || {};
    const all = (counts.alive || 0) + (counts.dead || 0);
    patch(this.filters, [state, counts], () => filterButtons([
      ['', `all (${fmtCount(all)})`],
      ['alive', `alive (${fmtCount(counts.alive)})`],
      ['dead', `dead (${fmtCount(counts.dead)})`],
    ], state, (value) => go({ state: value, offset: 0 })));
    const nodes = data.nodes || [];
    for (const holder of [this.pagerTop, this.pagerBottom]) {
      patch(holder, [offset, nodes.length, data.total, state], () =>
        pager(offset, NODES_PER_PAGE, nodes.length, data.total, (o) => go({ offset: o })));
    }
    this.empty.hidden = nodes.length > 0;
    const hosts = sharedHosts(nodes);
    patch(this.shared, hosts, () => hosts.map(([host, ids, total]) =>
      el('p', { class: 'banner error shared-host' },
        `Nodes ${ids.join(', ')} run on host ${host} and each takes its whole memory (${fmtBytes(total)}) as its own: `
        + 'set memory.total on each so that together they fit the host.')));
    syncRows(this.tbody, nodes, (n) => n.id, nodeRow);
  },
};

// Alive nodes of one host that each claim the same total memory: sized from the whole host
// (no memory.total), so together they claim it several times. [[host, ids, total]].
function sharedHosts(nodes) {
  const byHost = new Map();
  for (const node of nodes) {
    if (node.state !== 'alive' || !node.memory || typeof node.addr !== 'string') continue;
    const host = node.addr.replace(/:\d+$/, '');
    const key = `${host}/${node.memory.total_bytes}`;
    if (!byHost.has(key)) byHost.set(key, [host, [], node.memory.total_bytes]);
    byHost.get(key)[1].push(node.id);
  }
  return [...byHost.values()].filter(([, ids]) => ids.length > 1);
}

function poolBar(label, used, size, kind, note) {
  // A pool's bar shows how much of the pool is in use; its text gives both sizes.
  const fraction = isNum(used) && size > 0 ? Math.min(1, used / size) : 0;
  const text = isNum(used) ? `${fmtBytes(used)} / ${fmtBytes(size)}` : fmtBytes(size);
  const title = (isNum(used) ? `${label}: ${text} (${fmtPercent(used, size)})` : `${label}: ${text}`)
    + (note ? `; ${note}` : '');
  return el('div', { class: 'pool' },
    el('span', { class: 'pool-label' }, label),
    bar(fraction, kind, title),
    el('span', { class: 'pool-text' }, text));
}

function memoryCell(memory, usage) {
  const m = memory || {};
  const u = usage || {};
  const total = m.total_bytes;
  const reserveShare = total > 0 ? m.system_reserve_bytes / total : 0;
  return el('td', { class: 'memory' },
    poolBar('store', usage ? u.object_store_used_bytes : null, m.object_store_bytes, 'store'),
    // Heap used is the node's process tree's private memory, as its heartbeat says; what
    // jobs' leases reserve (their tasks' memory hints) is only in the tooltip.
    poolBar('heap', usage ? u.heap_used_bytes : null, m.heap_bytes, 'heap',
      usage ? `reserved by leases ${fmtBytes(u.heap_reserved_bytes)}` : null),
    el('div', { class: 'pool' },
      el('span', { class: 'pool-label' }, 'reserve'),
      bar(reserveShare, 'reserve', `system reserve: ${fmtBytes(m.system_reserve_bytes)} (${fmtPercent(m.system_reserve_bytes, total)} of total)`),
      el('span', { class: 'pool-text' }, fmtBytes(m.system_reserve_bytes),
        el('span', { class: 'muted' }, ` · total ${fmtBytes(total)}`))));
}

function nodeRow(node) {
  const usage = node.usage;
  const labels = Object.entries(node.labels || {});
  const age = node.heartbeat_age_ms;
  return el('tr', { dataset: { nodeId: node.id, state: node.state } },
    el('td', { class: 'mono' }, el('a', { href: `#/nodes/${encodeURIComponent(node.id)}` }, node.id)),
    el('td', null, el('span', { class: 'mono' }, textOf(node.addr)),
      labels.length ? el('div', { class: 'labels' }, labels.map(([k, v]) => el('span', { class: 'chip' }, `${k}=${v}`))) : null),
    el('td', null, badge(node.state),
      node.state === 'alive' ? el('div', null, el('a', { href: `#/logs?node=${encodeURIComponent(node.id)}` }, 'logs')) : null),
    num(usage ? `${usage.cpu_reserved} / ${node.cpus}` : textOf(node.cpus),
      { title: usage ? 'reserved / total cpus' : 'total cpus' }),
    memoryCell(node.memory, usage),
    num(usage ? fmtBytes(usage.object_store_used_bytes) : DASH),
    num(usage ? fmtBytes(usage.spilled_bytes) : DASH,
      { title: usage ? `fallback ${fmtBytes(usage.fallback_bytes)}` : null }),
    num(usage ? `${usage.workers_busy} / ${usage.workers}` : DASH),
    num(fmtDuration(age), { class: isNum(age) && age > 3000 ? 'num late' : 'num' }),
    el('td', { class: 'reason' }, node.dead_reason === null || node.dead_reason === undefined ? '' : String(node.dead_reason)));
}

pages.jobs = {
  mount(main, route) {
    this.filters = el('div');
    this.pagerTop = el('div');
    this.pagerBottom = el('div');
    this.name = el('input', { type: 'search', id: 'jobs-name', size: 20, placeholder: 'name contains', value: this.params(route).name });
    const nameForm = el('form', {
      class: 'name-filter',
      onsubmit: (event) => {
        event.preventDefault();
        location.hash = hashFor('jobs', { state: this.params(parseRoute()).state, name: this.name.value.trim() });
      },
    }, this.name, el('button', { type: 'submit' }, 'filter'));
    const { table: t, tbody } = table('jobs-table', [['id', 'num'], 'name', 'state', 'operators', ['attempts', 'num'],
      'driver', 'submitted', ['duration', 'num'], ['output rows', 'num'], 'error']);
    this.tbody = tbody;
    this.empty = el('p', { class: 'empty', hidden: true }, 'no jobs');
    setChildren(main, section('Jobs', el('div', { class: 'toolbar' }, this.filters, nameForm, this.pagerTop), t, this.empty, this.pagerBottom));
  },
  params(route) {
    const state = route.query.get('state');
    return {
      state: JOB_STATES.includes(state) ? state : '',
      name: route.query.get('name') || '',
      offset: offsetParam(route.query),
    };
  },
  load(route) {
    const { state, name, offset } = this.params(route);
    // `all`: jobs moved to this replica's history follow the live ones.
    const q = new URLSearchParams({ offset, limit: JOBS_PER_PAGE, all: 'true' });
    if (state) q.set('state', state);
    if (name) q.set('name', name);
    return api(`/api/jobs?${q}`);
  },
  render(data, cluster, route) {
    const { state, name, offset } = this.params(route);
    const go = (params) => { location.hash = hashFor('jobs', Object.assign({ state, name, offset }, params)); };
    if (offset > 0 && offset >= data.total) {
      go({ offset: Math.max(0, Math.floor((data.total - 1) / JOBS_PER_PAGE) * JOBS_PER_PAGE) });
      return;
    }
    const counts = data.counts || {};
    const all = JOB_STATES.reduce((sum, s) => sum + (counts[s] || 0), 0);
    patch(this.filters, [state, counts], () => filterButtons(
      [['', `all (${fmtCount(all)})`]].concat(JOB_STATES.map((s) => [s, `${s} (${fmtCount(counts[s] || 0)})`])),
      state, (value) => go({ state: value, offset: 0 })));
    const jobs = data.jobs || [];
    for (const holder of [this.pagerTop, this.pagerBottom]) {
      patch(holder, [offset, jobs.length, data.total, state, name], () =>
        pager(offset, JOBS_PER_PAGE, jobs.length, data.total, (o) => go({ offset: o })));
    }
    this.empty.hidden = jobs.length > 0;
    syncRows(this.tbody, jobs, (j) => j.id, jobRow);
    tickElapsed(this.tbody);
  },
};

// A job's duration: end − start once ended; while it runs, time since its start, and while
// it waits, time since its submission, both counted on in the page (`live-elapsed` cells).
function jobDuration(job) {
  if (isNum(job.ended_at_ms)) {
    return { ms: job.ended_at_ms - (isNum(job.started_at_ms) ? job.started_at_ms : job.submitted_at_ms), since: null };
  }
  const since = isNum(job.started_at_ms) ? job.started_at_ms : job.submitted_at_ms;
  return isNum(since) ? { ms: Date.now() - since, since } : { ms: null, since: null };
}

function durationCell(job) {
  const { ms, since } = jobDuration(job);
  const waiting = since !== null && !isNum(job.started_at_ms);
  return num(fmtDuration(ms), {
    class: since === null ? 'num' : 'num live-elapsed',
    dataset: since === null ? null : { since },
    title: since === null ? 'from start to end' : (waiting ? 'waiting since submitted' : 'running since started'),
  });
}

function tickElapsed(root) {
  for (const cell of root.querySelectorAll('.live-elapsed')) {
    cell.textContent = fmtDuration(Date.now() - Number(cell.dataset.since));
  }
}

function jobRow(job) {
  const href = `#/jobs/${encodeURIComponent(job.id)}`;
  const row = el('tr', { class: 'link-row', dataset: { jobId: job.id, state: job.state } },
    num(el('a', { href }, job.id)),
    el('td', { class: 'job-name' }, textOf(job.name)),
    el('td', null, badge(job.state), job.removed ? ` (${job.removed})` : ''),
    el('td', { class: 'ops' }, (job.operators || []).join(' → ')),
    num(fmtCount(job.attempts)),
    el('td', { class: 'mono' }, textOf(job.driver_node)),
    el('td', { class: 'nowrap', title: isNum(job.submitted_at_ms) ? new Date(job.submitted_at_ms).toString() : null },
      isNum(job.submitted_at_ms) ? fmtTime(job.submitted_at_ms) : DASH),
    durationCell(job),
    num(fmtCount(job.output_rows)),
    el('td', { class: 'error-cell', title: job.error || null }, job.error ? truncate(job.error, 90) : ''));
  row.addEventListener('click', (event) => {
    // Leave links and text selection alone; anywhere else on the row opens the job.
    if (event.target.closest('a') || String(window.getSelection())) return;
    location.hash = href;
  });
  return row;
}

pages.job = {
  mount(main, route) {
    this.id = route.id;
    this.head = el('div');
    this.error = el('div');
    this.graph = el('div');
    this.leases = el('div');
    this.stats = el('div');
    this.tasks = el('div');
    this.plan = el('div');
    setChildren(main,
      el('p', { class: 'crumbs' }, el('a', { href: document.querySelector('#nav a[data-page="jobs"]').getAttribute('href') }, '‹ jobs')),
      this.head, this.error, this.graph, this.leases, this.stats, this.tasks, this.plan);
  },
  load(route) {
    const id = encodeURIComponent(route.id);
    return Promise.all([api(`/api/jobs/${id}`), api(`/api/jobs/${id}/tasks`)])
      .then(([job, tasks]) => Object.assign(job, { taskTable: tasks }))
      .catch((e) => {
        if (e.status === 404) return { notFound: true };
        throw e;
      });
  },
  render(job) {
    if (job.notFound) {
      patch(this.head, 'missing', () => section(`Job ${this.id}`, el('p', { class: 'empty' }, `No job with id ${this.id} on this cluster.`)));
      for (const part of [this.error, this.graph, this.leases, this.stats, this.tasks, this.plan]) patch(part, null, () => []);
      return;
    }
    patch(this.tasks, job.taskTable, () => taskSection(job.taskTable));
    patch(this.leases, job.leases, () => leaseSection(job.leases, 'node'));
    patch(this.head, [job.state, job.attempts, job.driver_node, job.cancel_requested, job.rows_per_s,
      job.submission_id, job.options, job.output, job.stats && job.stats.wall_ms, job.stats && job.stats.spilled_bytes,
      job.started_at_ms, job.ended_at_ms], () => jobHead(job));
    const duration = this.head.querySelector('#job-duration');
    if (duration) duration.textContent = fmtDuration(jobDuration(job).ms);
    patch(this.error, job.error, () => (job.error === null || job.error === undefined
      ? []
      : section('Error', el('pre', { class: 'error-text' }, String(job.error)))));
    patch(this.graph, [job.state, job.progress, job.stats && job.stats.operators, job.operators], () => operatorGraph(job));
    patch(this.stats, job.stats, () => (job.stats ? statsTable(job.stats) : []));
    patch(this.plan, job.plan, () => section('Plan', el('pre', { class: 'plan' }, textOf(job.plan))));
  },
};

function jobHead(job) {
  const active = ACTIVE_JOB_STATES.includes(job.state);
  let cancel = null;
  if (active) {
    cancel = el('button', {
      type: 'button',
      class: 'danger',
      disabled: job.cancel_requested === true,
      onclick: () => {
        if (!confirm(`Cancel job ${job.id}?`)) return;
        runAction(async () => {
          const result = await mutate(`/api/jobs/${encodeURIComponent(job.id)}/stop`, {});
          if (!result) return null;
          return result.stopped
            ? `Job ${job.id}: ${result.message}.`
            : `Job ${job.id} was not stopped: ${result.message}.`;
        });
      },
    }, job.cancel_requested ? 'cancel requested…' : 'Cancel job');
  }
  const opts = job.options || {};
  const stats = job.stats;
  const output = job.output;
  const facts = [
    ['attempts', fmtCount(job.attempts)],
    ['driver node', textOf(job.driver_node)],
    ['rows/s', job.rows_per_s === null || job.rows_per_s === undefined ? DASH : fmtRate(job.rows_per_s)],
    ['submitted', isNum(job.submitted_at_ms) ? fmtTime(job.submitted_at_ms) : DASH],
    ['started', isNum(job.started_at_ms) ? fmtTime(job.started_at_ms) : DASH],
    ['ended', isNum(job.ended_at_ms) ? fmtTime(job.ended_at_ms) : DASH],
    ['duration', el('span', { id: 'job-duration' }, fmtDuration(jobDuration(job).ms))],
    ['wall', stats ? fmtDuration(stats.wall_ms) : DASH],
    ['spilled', stats ? fmtBytes(stats.spilled_bytes) : DASH],
    ['output', output ? `${fmtCount(output.rows)} rows · ${fmtCount(output.blocks)} blocks · ${fmtBytes(output.bytes)}` : DASH],
    ['cache', textOf(opts.cache)],
    ['max task retries', textOf(opts.max_task_retries)],
    ['store budget', isNum(opts.object_store_budget_permille) ? `${opts.object_store_budget_permille / 10}%` : DASH],
    ['submission id', textOf(job.submission_id)],
  ];
  return section(null,
    el('div', { class: 'job-title' },
      el('h2', null, `Job ${job.id}`),
      el('span', { id: 'job-state', class: `badge big st-${job.state}` }, job.state),
      job.cancel_requested && active ? el('span', { class: 'muted' }, 'cancel requested') : null,
      el('span', { class: 'spacer' }),
      el('a', { id: 'job-logs-link', href: `#/logs?job=${encodeURIComponent(job.id)}` }, 'logs'),
      cancel),
    el('dl', { class: 'facts' }, facts.map(([k, v]) =>
      el('div', null, el('dt', null, k), el('dd', { class: k === 'submission id' ? 'mono' : null }, v)))));
}

function operatorGraph(job) {
  const finished = !ACTIVE_JOB_STATES.includes(job.state);
  const progressOps = (job.progress && job.progress.operators) || [];
  const statsOps = (job.stats && job.stats.operators) || [];
  let ops;
  if (finished && statsOps.length) {
    ops = statsOps.map((s, i) => ({ name: s.name, stats: s, progress: progressOps[i] && progressOps[i].name === s.name ? progressOps[i] : null }));
  } else if (progressOps.length) {
    ops = progressOps.map((p) => ({ name: p.name, progress: p, stats: null }));
  } else {
    ops = (job.operators || []).map((name) => ({ name, progress: null, stats: null }));
  }
  if (ops.length === 0) {
    return section('Operators', el('p', { class: 'empty' },
      job.state === 'pending' ? 'waiting for a driver to report progress' : 'no operator progress reported'));
  }
  const chain = el('div', { class: 'chain' });
  ops.forEach((op, i) => {
    if (i > 0) chain.append(el('div', { class: 'arrow' }, '→'));
    chain.append(operatorBox(op, job.state));
  });
  const note = job.progress ? `driver report of attempt ${job.progress.attempt}` : null;
  return section(null, el('div', { class: 'chart-title' }, el('h2', null, 'Operators'), note ? el('span', { class: 'muted' }, note) : null), chain);
}

function operatorBox(op, state) {
  const p = op.progress;
  const s = op.stats;
  const known = p && isNum(p.tasks_total) && p.tasks_total > 0;
  let progressBar;
  let tasksText;
  if (state === 'succeeded') {
    progressBar = bar(1, 'succeeded');
    tasksText = s ? `${fmtCount(s.tasks)} tasks` : 'done';
  } else if (known) {
    progressBar = bar(p.tasks_done / p.tasks_total, state);
    tasksText = `${fmtCount(p.tasks_done)} / ${fmtCount(p.tasks_total)} tasks`;
  } else {
    progressBar = ACTIVE_JOB_STATES.includes(state)
      ? el('div', { class: 'bar indeterminate' }, el('div', { class: 'fill' }))
      : bar(0, state);
    tasksText = p ? `${fmtCount(p.tasks_done)} tasks done` : s ? `${fmtCount(s.tasks)} tasks` : 'tasks unknown';
  }
  const rows = s ? s.rows : p ? p.rows_done : null;
  const bytes = s ? s.bytes : p ? p.bytes_done : null;
  const blocks = p ? p.blocks_done : null;
  return el('div', { class: 'operator' },
    el('div', { class: 'op-name' }, op.name),
    progressBar,
    el('div', { class: 'op-tasks muted small' }, tasksText,
      p && (p.tasks_running || p.tasks_queued) ? ` · ${fmtCount(p.tasks_running)} running · ${fmtCount(p.tasks_queued)} queued` : ''),
    el('dl', { class: 'op-facts' },
      el('dt', null, 'rows'), el('dd', null, fmtCount(rows)),
      el('dt', null, 'blocks'), el('dd', null, fmtCount(blocks)),
      el('dt', null, 'bytes'), el('dd', null, fmtBytes(bytes)),
      s ? [el('dt', null, 'wall'), el('dd', null, fmtDuration(s.wall_ms))] : null));
}

// The table shows the newest runs; the timeline draws up to this many.
const TASK_ROWS = 300;
const TIMELINE_TASKS = 3000;

function taskSection(data) {
  const tasks = data.tasks || [];
  if (!data.available) {
    return section('Tasks', el('p', { class: 'empty', id: 'tasks-unavailable' },
      'No task table: the node that ran this job\'s driver is gone, or newer jobs pushed the table out.'));
  }
  const running = tasks.filter((t) => t.state === 'running').length;
  const failed = tasks.filter((t) => t.state === 'failed').length;
  const summary = `${fmtCount(tasks.length)} runs (${fmtCount(running)} running, ${fmtCount(failed)} failed)`
    + `, driver attempt ${textOf(data.attempt)} on node ${textOf(data.driver_node)}`
    + (data.dropped ? `, ${fmtCount(data.dropped)} older runs left out` : '');
  const { table: t, tbody } = table('tasks-table', ['operator', ['task', 'num'], 'node', 'worker', ['attempt', 'num'],
    'state', ['rows', 'num'], ['bytes', 'num'], 'start', ['duration', 'num'], 'error']);
  const shown = tasks.slice(-TASK_ROWS).reverse();
  for (const task of shown) {
    tbody.append(el('tr', { dataset: { task: task.task, state: task.state } },
      el('td', null, textOf(task.operator)),
      num(String(task.seq), { title: `task id ${task.task}` }),
      el('td', { class: 'mono' }, task.node === null || task.node === undefined ? DASH : String(task.node)),
      el('td', { class: 'mono', title: task.worker ? `worker process ${task.worker.pid}` : 'known once the run ends' },
        workerText(task.worker)),
      num(String(task.attempt), { class: task.attempt > 1 ? 'num warn' : 'num' }),
      el('td', null, badge(task.state)),
      num(fmtCount(task.rows)),
      num(fmtBytes(task.bytes)),
      el('td', { class: 'nowrap', title: new Date(task.started_ms).toString() }, fmtClock(task.started_ms)),
      num(fmtDuration(task.duration_ms)),
      el('td', { class: 'reason' }, textOf(task.error === null ? '' : task.error))));
  }
  return section('Tasks',
    el('p', { class: 'muted', id: 'tasks-summary' }, summary
      + (tasks.length > TASK_ROWS ? `; the table shows the newest ${TASK_ROWS}` : '')),
    timeline(tasks.slice(-TIMELINE_TASKS)),
    t);
}

// A worker as the task table shows it: its slot on the node and its process.
function workerText(worker) {
  return worker ? `w${worker.slot} (pid ${worker.pid})` : DASH;
}

// One lane per node worker: a finished run sits in its worker slot's lane; runs whose worker
// is not known yet (running, or never reached one) are packed into as few extra lanes of
// their node as ran at once; runs not placed yet have lanes of their own.
function timeline(tasks) {
  if (tasks.length === 0) return el('p', { class: 'empty' }, 'no task has started');
  const now = Date.now();
  const t0 = Math.min(...tasks.map((t) => t.started_ms));
  const t1 = Math.max(t0 + 1, ...tasks.map((t) => t.ended_ms || now));
  const byNode = new Map();
  for (const task of [...tasks].sort((a, b) => a.started_ms - b.started_ms)) {
    // A run's node is known once it is placed; those still being placed share lanes.
    const key = task.node === null || task.node === undefined ? 'placing' : `node ${task.node}`;
    if (!byNode.has(key)) byNode.set(key, { workers: new Map(), lanes: [] });
    const node = byNode.get(key);
    if (task.worker) {
      const slot = task.worker.slot;
      if (!node.workers.has(slot)) node.workers.set(slot, []);
      node.workers.get(slot).push(task);
      continue;
    }
    const end = task.ended_ms || now;
    let lane = node.lanes.find((l) => l.end <= task.started_ms);
    if (!lane) {
      lane = { end: 0, tasks: [] };
      node.lanes.push(lane);
    }
    lane.end = end;
    lane.tasks.push(task);
  }
  const rows = [];
  for (const [name, node] of [...byNode.entries()].sort()) {
    for (const [slot, runs] of [...node.workers.entries()].sort((a, b) => a[0] - b[0])) {
      rows.push({ label: `${name} · w${slot}`, tasks: runs });
    }
    node.lanes.forEach((lane, i) => rows.push({ label: `${name} · ${node.workers.size ? 'running' : i + 1}${node.workers.size && node.lanes.length > 1 ? ` ${i + 1}` : ''}`, tasks: lane.tasks }));
  }
  const laneH = 16;
  const pad = { left: 80, right: 10, top: 4, bottom: 16 };
  const width = 1000;
  const height = pad.top + rows.length * laneH + pad.bottom;
  const x = (t) => pad.left + ((t - t0) / (t1 - t0)) * (width - pad.left - pad.right);
  const chart = svg('svg', { viewBox: `0 0 ${width} ${height}`, width: '100%', class: 'timeline', id: 'task-timeline', role: 'img' });
  rows.forEach((row, i) => {
    const y = pad.top + i * laneH;
    chart.append(svg('text', { x: pad.left - 6, y: y + laneH - 4, 'text-anchor': 'end', class: 'axis' }, row.label));
    for (const task of row.tasks) {
      const x0 = x(task.started_ms);
      const w = Math.max(1.5, x(task.ended_ms || now) - x0);
      const rect = svg('rect', { x: x0, y: y + 2, width: w, height: laneH - 4, class: `span st-${task.state}` });
      rect.append(svg('title', {}, `${task.operator} #${task.seq} attempt ${task.attempt}: ${task.state}, ${fmtDuration(task.duration_ms)}, ${fmtCount(task.rows)} rows${task.worker ? `, worker pid ${task.worker.pid}` : ''}`));
      chart.append(rect);
    }
  });
  for (const [t, anchor] of [[t0, 'start'], [t1, 'end']]) {
    chart.append(svg('text', { x: x(t), y: height - 6, 'text-anchor': anchor, class: 'axis' }, fmtClock(t)));
  }
  return el('div', { class: 'timeline-holder' }, chart);
}

function statsTable(stats) {
  const { table: t, tbody } = table('stats-table', ['operator', 'fingerprint', ['wall', 'num'], ['tasks', 'num'],
    ['retries', 'num'], ['rebuilt', 'num'], ['rows', 'num'], ['bytes', 'num'], ['cache hits', 'num'],
    ['cache misses', 'num'], 'hot key']);
  for (const op of stats.operators || []) {
    tbody.append(el('tr', null,
      el('td', null, op.name),
      el('td', { class: 'mono small' }, textOf(op.fingerprint)),
      num(fmtDuration(op.wall_ms)),
      num(fmtCount(op.tasks)),
      num(fmtCount(op.retries), { class: op.retries > 0 ? 'num warn' : 'num' }),
      num(fmtCount(op.rebuilt), { class: op.rebuilt > 0 ? 'num warn' : 'num' }),
      num(fmtCount(op.rows)),
      num(fmtBytes(op.bytes)),
      num(fmtCount(op.cache_hits)),
      num(fmtCount(op.cache_misses)),
      el('td', { class: 'hot-key' }, op.hot_key === null || op.hot_key === undefined ? '' : textOf(op.hot_key))));
  }
  return section(`Statistics (attempt ${textOf(stats.attempt)}, wall ${fmtDuration(stats.wall_ms)}, spilled ${fmtBytes(stats.spilled_bytes)})`, t);
}

pages.cache = {
  mount(main) {
    this.summary = el('div', { class: 'toolbar' });
    const { table: t, tbody } = table('cache-table', ['fingerprint', 'made by', ['shards', 'num'], 'complete',
      ['rows', 'num'], ['size', 'num'], 'shards per node', ['age', 'num'], ['hits', 'num'], 'last used', '']);
    this.tbody = tbody;
    this.empty = el('p', { class: 'empty', hidden: true }, 'the cache is empty');
    setChildren(main, section('Cache', this.summary, t, this.empty));
  },
  load() {
    return api('/api/cache');
  },
  render(data) {
    const entries = data.entries || [];
    patch(this.summary, [data.total_bytes, entries.length], () => [
      el('span', null, `${fmtCount(entries.length)} entries · ${fmtBytes(data.total_bytes)} in total`),
      el('span', { class: 'spacer' }),
      el('button', { type: 'button', class: 'danger', disabled: entries.length === 0, onclick: cleanAll }, 'Clean all'),
    ]);
    this.empty.hidden = entries.length > 0;
    // One row per fingerprint and shard count, as the API lists them.
    syncRows(this.tbody, entries, (e) => `${e.fingerprint}/${e.shard_count}`, cacheRow);
    tickElapsed(this.tbody);
  },
};

function cacheRow(entry) {
  const perNode = Object.entries(entry.shards_per_node || {}).map(([node, shards]) => `${node}: ${shards}`);
  const nodeText = perNode.length > 8 ? `${perNode.slice(0, 8).join(', ')} … (+${perNode.length - 8})` : perNode.join(', ');
  const madeBy = entry.job === null || entry.job === undefined
    ? el('span', { class: 'muted', title: 'shards a node found on disk when it joined' }, 'found on disk')
    : el('span', null, el('a', { href: `#/jobs/${encodeURIComponent(entry.job)}` }, `job ${entry.job}`),
      ` · ${textOf(entry.operator)}`);
  return el('tr', { dataset: { fingerprint: entry.fingerprint, job: entry.job || '' } },
    el('td', { class: 'mono' }, entry.fingerprint),
    el('td', { class: 'made-by' }, madeBy),
    num(`${fmtCount(entry.shards_present)} / ${fmtCount(entry.shard_count)}`),
    el('td', null, entry.complete ? badge('ok', 'complete') : badge('degraded', 'partial')),
    num(fmtCount(entry.rows)),
    num(fmtBytes(entry.bytes)),
    el('td', { class: 'mono', title: perNode.join(', ') }, nodeText),
    num(isNum(entry.created_at_ms) ? fmtDuration(Math.max(0, Date.now() - entry.created_at_ms)) : DASH,
      isNum(entry.created_at_ms)
        ? { class: 'num live-elapsed', dataset: { since: entry.created_at_ms }, title: new Date(entry.created_at_ms).toString() }
        : { title: 'not known for shards found on disk' }),
    num(fmtCount(entry.hits), { title: 'shards served to jobs that succeeded while this replica watched' }),
    el('td', { title: isNum(entry.last_used_ms) ? fmtAgo(entry.last_used_ms) : 'not seen by this replica since it started' },
      fmtTime(entry.last_used_ms)),
    el('td', null, el('button', { type: 'button', class: 'small', onclick: () => cleanEntry(entry.fingerprint) }, 'clean')));
}

function cleanEntry(fingerprint) {
  if (!confirm(`Drop cache entry ${fingerprint}? The next job that needs it recomputes it.`)) return;
  runAction(async () => {
    const result = await mutate('/api/cache/clean', { fingerprint });
    return result ? `Evicted ${fmtCount(result.evicted)} entr${result.evicted === 1 ? 'y' : 'ies'}.` : null;
  });
}

function cleanAll() {
  if (!confirm('Drop every cache entry? Jobs will recompute what they used to reuse.')) return;
  runAction(async () => {
    const result = await mutate('/api/cache/clean', {});
    return result ? `Evicted ${fmtCount(result.evicted)} entr${result.evicted === 1 ? 'y' : 'ies'}.` : null;
  });
}

// Events accumulate across visits; seq is per replica, so a different serving replica starts over.
const eventLog = { replica: null, lastSeq: null, rows: [] };

pages.events = {
  mount(main) {
    const { table: t, tbody } = table('events-table', [['seq', 'num'], 'time', 'kind', 'node', 'job', 'message']);
    this.tbody = tbody;
    this.count = el('span', { class: 'muted' });
    this.empty = el('p', { class: 'empty', hidden: true }, 'no events yet');
    setChildren(main, section(null, el('div', { class: 'chart-title' }, el('h2', null, 'Events'), this.count), t, this.empty));
    // Rebuild from what was collected before, newest first.
    for (const event of eventLog.rows) this.tbody.prepend(eventRow(event));
  },
  load() {
    const after = eventLog.lastSeq;
    return api(after === null ? '/api/events' : `/api/events?after=${encodeURIComponent(after)}`)
      .then((data) => ({ data, after }));
  },
  render({ data, after }, cluster) {
    if (eventLog.replica !== null && eventLog.replica !== cluster.replica_id) {
      // Another replica answered: its seqs are its own, so start the list over on the next poll.
      eventLog.replica = cluster.replica_id;
      eventLog.lastSeq = null;
      eventLog.rows = [];
      this.tbody.replaceChildren();
      return;
    }
    eventLog.replica = cluster.replica_id;
    if (after !== eventLog.lastSeq) return;
    const fresh = (data.events || []).filter((e) => eventLog.lastSeq === null || e.seq > eventLog.lastSeq);
    for (const event of fresh) {
      eventLog.rows.push(event);
      this.tbody.prepend(eventRow(event));
      eventLog.lastSeq = event.seq;
    }
    while (eventLog.rows.length > MAX_EVENT_ROWS) {
      eventLog.rows.shift();
      if (this.tbody.lastChild) this.tbody.lastChild.remove();
    }
    this.empty.hidden = eventLog.rows.length > 0;
    this.count.textContent = `${fmtCount(eventLog.rows.length)} shown, newest first`;
  },
};

const EVENT_STATE = { node_joined: 'alive', node_dead: 'dead', leader_changed: 'running', job_state: 'pending' };

function eventRow(event) {
  return el('tr', { dataset: { seq: event.seq, kind: event.kind } },
    num(String(event.seq)),
    el('td', { class: 'nowrap', title: new Date(event.time_ms).toString() }, fmtTime(event.time_ms)),
    el('td', null, badge(EVENT_STATE[event.kind] || 'pending', event.kind)),
    el('td', { class: 'mono' }, event.node === null || event.node === undefined ? '' : String(event.node)),
    el('td', { class: 'mono' }, event.job === null || event.job === undefined
      ? ''
      : el('a', { href: `#/jobs/${encodeURIComponent(event.job)}` }, String(event.job))),
    el('td', null, textOf(event.message)));
}

// ---------- one node ----------

pages.node = {
  mount(main, route) {
    this.id = route.id;
    this.head = el('div');
    this.memory = el('div');
    this.leases = el('div');
    this.store = el('div');
    this.objects = el('div');
    this.work = el('div');
    this.udfs = el('div');
    this.tasksChart = chartCard('Tasks running');
    this.rowsChart = chartCard('Rows produced/s');
    this.spillChart = chartCard('Spilled');
    this.networkChart = chartCard('Network (bytes received/s)');
    this.cpuChart = chartCard('CPU used');
    this.charts = el('div', { class: 'charts', id: 'node-charts' }, this.tasksChart.card, this.rowsChart.card,
      this.spillChart.card, this.networkChart.card, this.cpuChart.card);
    this.chartsKey = null;
    setChildren(main,
      el('p', { class: 'crumbs' }, el('a', { href: '#/nodes' }, '‹ nodes')),
      this.head, this.memory, this.leases, this.store, this.objects, this.work, this.udfs,
      section('The last hour (one point per 10 s)'), this.charts);
  },
  load(route) {
    const id = encodeURIComponent(route.id);
    const notFound = (e) => {
      if (e.status === 404) return { notFound: true };
      throw e;
    };
    return Promise.all([api(`/api/nodes/${id}`).catch(notFound), api(`/api/nodes/${id}/history`).catch(notFound)])
      .then(([node, history]) => (node.notFound ? node : Object.assign(node, { history })));
  },
  render(node) {
    if (node.notFound) {
      patch(this.head, 'missing', () => section(`Node ${this.id}`, el('p', { class: 'empty' }, `No node with id ${this.id} on this cluster.`)));
      for (const part of [this.memory, this.leases, this.store, this.objects, this.work, this.udfs]) patch(part, null, () => []);
      return;
    }
    const live = node.live;
    const leases = node.usage ? node.usage.leases : [];
    patch(this.leases, leases, () => leaseSection(leases, 'job'));
    patch(this.head, [node.state, node.addr, node.dead_reason, node.cpus, node.live_error], () => section(null,
      el('div', { class: 'job-title' },
        el('h2', null, `Node ${node.id}`),
        el('span', { id: 'node-state', class: `badge big st-${node.state}` }, node.state),
        el('span', { class: 'mono' }, textOf(node.addr)),
        el('span', { class: 'spacer' }),
        node.state === 'alive' ? el('a', { href: `#/logs?node=${encodeURIComponent(node.id)}` }, 'logs') : null),
      node.dead_reason ? el('p', { class: 'reason' }, String(node.dead_reason)) : null,
      node.live_error && node.state === 'alive' ? el('p', { class: 'error-text' }, `the node did not answer: ${node.live_error}`) : null));
    patch(this.memory, [node.memory, node.usage, node.cpus, live && live.cpu_utilization, live && live.heap_used_bytes], () => {
      const pools = el('table', { class: 'grid', id: 'node-memory' },
        el('tbody', null, el('tr', null, memoryCell(node.memory, node.usage))));
      const facts = el('dl', { class: 'facts', id: 'node-cpu' },
        [['cpus', textOf(node.cpus)],
          ['CPU used', live ? fmtPercent(live.cpu_utilization, 1) : DASH],
          ['reserved by leases', node.usage ? `${textOf(node.usage.cpu_reserved)} cpus` : DASH],
          ['heap used', live ? fmtBytes(live.heap_used_bytes) : DASH],
          ['total memory', node.memory ? fmtBytes(node.memory.total_bytes) : DASH]]
          .map(([k, v]) => el('div', null, el('dt', null, k), el('dd', { dataset: { fact: k } }, v))));
      return section('Memory and CPU', pools, facts);
    });
    patch(this.store, live && live.store, () => (live ? section('Object store', el('dl', { class: 'facts', id: 'node-store' },
      [['used', `${fmtBytes(live.store.used_bytes)} of ${fmtBytes(live.store.capacity_bytes)}`],
        ['objects in memory', fmtCount(live.store.objects_in_memory)],
        ['pinned', `${fmtBytes(live.store.pinned_bytes)} (${fmtCount(live.store.pinned_objects)} objects)`],
        ['spilled now', `${fmtBytes(live.store.spilled_bytes)} (${fmtCount(live.store.spilled_objects)} objects)`],
        ['spilled in total', fmtBytes(live.store.spilled_bytes_total)],
        ['restored in total', fmtBytes(live.store.restored_bytes_total)],
        ['fallback', `${fmtBytes(live.store.fallback_bytes)} (${fmtCount(live.store.fallback_objects)} objects)`]]
        .map(([k, v]) => el('div', null, el('dt', null, k), el('dd', { dataset: { fact: k } }, v))))) : []));
    patch(this.objects, live && live.largest_objects, () => {
      if (!live) return [];
      const { table: t, tbody } = table('node-objects', ['object', ['size', 'num'], 'where', ['pins', 'num'], 'job']);
      for (const object of live.largest_objects) {
        tbody.append(el('tr', { dataset: { object: object.object } },
          el('td', { class: 'mono' }, object.object),
          num(fmtBytes(object.size_bytes)),
          el('td', null, badge(object.residence === 'memory' ? 'ok' : 'degraded', object.residence)),
          num(fmtCount(object.pins)),
          el('td', { class: 'mono' }, object.job ? el('a', { href: `#/jobs/${encodeURIComponent(object.job)}` }, object.job) : DASH)));
      }
      return section('Largest objects', live.largest_objects.length ? t : el('p', { class: 'empty' }, 'the store holds no objects'));
    });
    patch(this.work, live && [live.workers, live.worker_slots, live.tasks_finished, live.tasks_failed, live.actors], () => {
      if (!live) return [];
      const { table: t, tbody } = table('node-workers-table', [['slot', 'num'], ['pid', 'num'], 'task']);
      for (const slot of live.worker_slots) {
        tbody.append(el('tr', { dataset: { slot: slot.slot, state: slot.task ? 'busy' : 'idle' } },
          num(String(slot.slot)),
          num(isNum(slot.pid) ? String(slot.pid) : DASH),
          el('td', { class: 'mono' }, slot.task ? slot.task : el('span', { class: 'muted' }, 'idle'))));
      }
      return section('Workers and tasks',
        el('p', { id: 'node-workers' }, `${fmtCount(live.workers)} workers ready, ${fmtCount(live.running.length)} running a task; `
          + `${fmtCount(live.tasks_finished)} tasks finished, ${fmtCount(live.tasks_failed)} failed, `
          + `${fmtCount(live.workers_respawned)} workers restarted, ${fmtCount(live.pulls_started)} pulls, `
          + `${fmtBytes(live.borrowed_bytes)} read in place from nodes on this host; `
          + `${fmtCount(live.actors.length)} actors hosted (`, el('a', { href: '#/actors' }, 'actors'), ')'),
        t);
    });
    patch(this.udfs, live && live.udf_pools, () => {
      if (!live) return [];
      const { table: t, tbody } = table('node-udf-pools', ['command', ['min', 'num'], ['max', 'num'], ['starting', 'num'], 'processes']);
      for (const pool of live.udf_pools) {
        tbody.append(el('tr', null,
          el('td', { class: 'mono' }, pool.command),
          num(String(pool.min)), num(String(pool.max)), num(String(pool.starting)),
          el('td', { class: 'mono' }, pool.processes.length
            ? pool.processes.map((p) => `${p.pid} (${p.state})`).join(', ')
            : el('span', { class: 'muted' }, 'none'))));
      }
      return section('Process-UDF pools', live.udf_pools.length ? t
        : el('p', { class: 'empty' }, 'no process UDF ran here lately'));
    });
    const samples = (node.history && node.history.samples) || [];
    const key = [samples.length, samples.length ? samples[samples.length - 1].time_ms : null, this.charts.clientWidth];
    if (JSON.stringify(key) !== this.chartsKey) {
      this.chartsKey = JSON.stringify(key);
      drawChart(this.tasksChart, samples, (x) => x.tasks_running, fmtCount, 10);
      drawChart(this.rowsChart, samples, (x) => x.rows_per_s, fmtRate, 10);
      drawChart(this.spillChart, samples, (x) => x.spilled_bytes, fmtBytes, 1024);
      drawChart(this.networkChart, samples, (x) => x.network_bytes_per_s, fmtBytesRate, 1024);
      drawChart(this.cpuChart, samples, (x) => x.cpu_utilization, (v) => fmtPercent(v, 1), 10);
    }
  },
};

// ---------- actors ----------

pages.actors = {
  mount(main) {
    const { table: t, tbody } = table('actors-table', ['actor', 'kind', 'job', 'node', 'state', ['calls', 'num'],
      ['restarts', 'num']]);
    this.tbody = tbody;
    this.empty = el('p', { class: 'empty', hidden: true }, 'no actors: drivers and shuffle aggregators live while their job runs');
    setChildren(main, section('Actors', t, this.empty));
  },
  load() {
    return api('/api/actors');
  },
  render(data) {
    const actors = data.actors || [];
    this.empty.hidden = actors.length > 0;
    syncRows(this.tbody, actors, (a) => a.id, (actor) => el('tr', { dataset: { actor: actor.id } },
      el('td', { class: 'mono' }, actor.id),
      el('td', null, actor.kind),
      el('td', { class: 'mono' }, el('a', { href: `#/jobs/${encodeURIComponent(actor.job)}` }, actor.job)),
      el('td', { class: 'mono' }, el('a', { href: `#/nodes/${encodeURIComponent(actor.node)}` }, actor.node)),
      el('td', null, badge(actor.state === 'alive' ? 'alive' : 'dead', actor.state)),
      num(isNum(actor.calls) ? fmtCount(actor.calls) : DASH,
        { title: actor.kind === 'JobDriver' ? 'a driver takes no calls' : 'pushes and reduces its driver sent' }),
      num(isNum(actor.restarts) ? fmtCount(actor.restarts) : DASH)));
  },
};

// ---------- logs ----------
// One node's log lines, or one job's from every node, fetched on demand from the nodes.

const LOG_LEVELS = ['', 'trace', 'debug', 'info', 'warn', 'error'];
const LOG_TAILS = [100, 200, 1000, 5000];

pages.logs = {
  mount(main, route) {
    const p = this.params(route);
    this.target = el('input', { type: 'text', id: 'logs-target', size: 10, placeholder: 'node or job id', value: p.node || p.job || '' });
    this.kind = el('select', { id: 'logs-kind' },
      el('option', { value: 'node', selected: !p.job }, 'node'),
      el('option', { value: 'job', selected: Boolean(p.job) }, 'job'));
    this.q = el('input', { type: 'search', id: 'logs-q', size: 24, placeholder: 'search text', value: p.q });
    this.level = el('select', { id: 'logs-level' },
      LOG_LEVELS.map((l) => el('option', { value: l, selected: l === p.level }, l || 'any level')));
    this.tail = el('select', { id: 'logs-tail' },
      LOG_TAILS.map((n) => el('option', { value: String(n), selected: n === p.tail }, `last ${n}`)));
    const form = el('form', { class: 'toolbar log-form', onsubmit: (event) => { event.preventDefault(); this.go(); } },
      this.kind, this.target, this.q, this.level, this.tail, el('button', { type: 'submit' }, 'show'));
    this.follow = el('input', { type: 'checkbox', id: 'logs-follow', checked: true });
    this.status = el('span', { class: 'muted', id: 'logs-status' });
    const { table: t, tbody } = table('logs-table', ['time', 'node', 'source', 'level', 'line']);
    this.tbody = tbody;
    this.empty = el('p', { class: 'empty', hidden: true }, 'no matching lines');
    this.hint = el('p', { class: 'empty', hidden: true }, 'Name a node or a job to read its logs (nodes page: "logs"; job page: "logs").');
    setChildren(main, section('Logs', form,
      el('div', { class: 'toolbar' }, el('label', null, this.follow, ' follow'), this.status),
      this.hint, t, this.empty));
    this.shown = null;
  },
  params(route) {
    const tail = parseInt(route.query.get('tail') || '200', 10);
    const level = route.query.get('level') || '';
    return {
      node: route.query.get('node') || '',
      job: route.query.get('job') || '',
      q: route.query.get('q') || '',
      level: LOG_LEVELS.includes(level) ? level : '',
      tail: LOG_TAILS.includes(tail) ? tail : 200,
    };
  },
  go() {
    const id = this.target.value.trim();
    const params = { q: this.q.value, level: this.level.value, tail: this.tail.value === '200' ? '' : this.tail.value };
    params[this.kind.value] = id;
    // Another hash remounts the page with these inputs; the same one just reloads.
    const hash = hashFor('logs', params);
    if (location.hash === hash) refresh(); else location.hash = hash;
  },
  path(p) {
    const q = new URLSearchParams({ tail: p.tail });
    if (p.q) q.set('q', p.q);
    if (p.level) q.set('level', p.level);
    if (p.job) return `/api/jobs/${encodeURIComponent(p.job)}/logs?${q}`;
    if (p.node) return `/api/nodes/${encodeURIComponent(p.node)}/logs?${q}`;
    return null;
  },
  load(route) {
    const path = this.path(this.params(route));
    // Without follow, the lines stay as first fetched.
    if (path === null || (this.shown !== null && !this.follow.checked)) return Promise.resolve(null);
    return api(path);
  },
  render(data, cluster, route) {
    const p = this.params(route);
    this.hint.hidden = this.path(p) !== null;
    if (data === null) return;
    this.shown = data;
    const lines = data.lines || [];
    const unreachable = data.unreachable || [];
    this.status.textContent = `${fmtCount(lines.length)} line${lines.length === 1 ? '' : 's'}`
      + (p.job ? ` of job ${p.job} from every node` : ` of node ${p.node}`)
      + (unreachable.length ? `; no answer from node ${unreachable.map((u) => u.node).join(', ')}` : '');
    this.empty.hidden = lines.length > 0;
    const key = JSON.stringify(lines.length ? [lines.length, lines[lines.length - 1]] : []);
    if (this.tbody.dataset.key === key) return;
    this.tbody.dataset.key = key;
    this.tbody.replaceChildren(...lines.map(logRow));
  },
};

function logRow(line) {
  const level = line.level ? line.level.toLowerCase() : '';
  return el('tr', { class: level ? `log-${level}` : null },
    el('td', { class: 'nowrap mono' }, line.time ? line.time.replace('T', ' ').replace(/\.\d+Z$/, 'Z') : ''),
    el('td', { class: 'mono' }, el('a', { href: `#/logs?node=${encodeURIComponent(line.node)}` }, String(line.node))),
    el('td', { class: 'mono' }, textOf(line.source)),
    el('td', null, level),
    el('td', { class: 'log-line mono' }, textOf(line.text)));
}

pages.notfound = {
  mount(main) {
    setChildren(main, section('Not found', el('p', null, 'No such page. ', el('a', { href: '#/overview' }, 'Go to the overview.'))));
  },
  load() {
    return Promise.resolve(null);
  },
  render() {},
};

// ---------- the refresh loop ----------

let generation = 0;
let timer = null;
let mounted = null;

function mountKey(route) {
  if (route.page === 'job') return `job/${route.id}`;
  if (route.page === 'node') return `node/${route.id}`;
  // A logs page is mounted with its inputs filled from the hash.
  if (route.page === 'logs') return `logs?${route.query}`;
  return route.page;
}

async function refresh() {
  clearTimeout(timer);
  generation += 1;
  const mine = generation;
  const route = parseRoute();
  const page = pages[route.page];
  const main = document.getElementById('main');
  if (mounted !== mountKey(route)) {
    mounted = mountKey(route);
    // Until the new page has rendered its first answer (tests wait for this).
    document.body.dataset.loaded = 'false';
    page.mount(main, route);
  }
  rememberNav(route);
  try {
    const [cluster, data] = await Promise.all([api('/api/cluster'), page.load(route)]);
    if (mine !== generation) return;
    renderHeader(cluster, navPage(route));
    page.render(data, cluster, route);
    clearBanner();
    document.body.dataset.loaded = 'true';
  } catch (e) {
    if (mine !== generation) return;
    showBanner(e.message);
  } finally {
    if (mine === generation) timer = setTimeout(refresh, POLL_MS);
  }
}

// Coalesces a burst of triggers (a window being resized) into one refresh.
function refreshSoon() {
  clearTimeout(timer);
  timer = setTimeout(refresh, 200);
}

window.addEventListener('hashchange', refresh);
window.addEventListener('resize', () => {
  if (mounted === 'overview') refreshSoon();
});
document.addEventListener('DOMContentLoaded', () => {
  document.getElementById('token-link').addEventListener('click', onTokenLink);
  showTokenState();
  refresh();
});
