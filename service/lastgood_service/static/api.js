// The REST API, with the bearer token (if the service asks for one) on every call.
//
// With no auth configured the service never answers 401 and the page never asks. When it
// does, the page asks for a token once per tab: it is kept in sessionStorage (gone when the
// tab closes) and sent as `Authorization: Bearer <token>`.

const TOKEN_KEY = 'lastgood.token';

export class AuthRequired extends Error {
  constructor(message, hadToken) {
    super(message);
    this.name = 'AuthRequired';
    this.hadToken = hadToken;
  }
}

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.name = 'ApiError';
    this.status = status;
    this.code = code;
  }
}

export function token() {
  try {
    return sessionStorage.getItem(TOKEN_KEY);
  } catch {
    return null;
  }
}

export function setToken(value) {
  if (value) sessionStorage.setItem(TOKEN_KEY, value);
  else sessionStorage.removeItem(TOKEN_KEY);
}

/** One API call -> parsed JSON. Throws AuthRequired on 401, ApiError on any other failure. */
export async function api(method, path, body) {
  const headers = { Accept: 'application/json' };
  const t = token();
  if (t) headers.Authorization = `Bearer ${t}`;
  const init = { method, headers, cache: 'no-store', credentials: 'same-origin', redirect: 'error' };
  if (body !== undefined) {
    headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (e) {
    throw new ApiError(0, 'unreachable', `the service did not answer (${e.message})`);
  }
  const type = response.headers.get('content-type') || '';
  const data = type.includes('application/json') ? await response.json().catch(() => null) : null;
  const err = data && typeof data === 'object' ? data.error : null;
  if (response.status === 401) {
    throw new AuthRequired((err && err.message) || 'a token is required', Boolean(t));
  }
  if (!response.ok) {
    throw new ApiError(response.status, err ? err.code : 'http_error',
      (err && err.message) || `HTTP ${response.status}`);
  }
  return data;
}

export const get = (path) => api('GET', path);

/** A path segment from a user string (run names, tag names). */
export const seg = (s) => encodeURIComponent(String(s));
