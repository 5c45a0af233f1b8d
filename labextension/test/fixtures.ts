/**
 * Jobs, snapshots and errors as the server's API returns them (server/openapi.yaml), with
 * only the fields a test cares about given, and the server's event stream.
 */
import type { Event } from '@jupyterlab/services';
import { Gettext, TranslationBundle } from '@jupyterlab/translation';
import { Signal } from '@lumino/signaling';
import type * as React from 'react';
import type { IJob, IJobError, IKernelStatus, ISnapshotSummary } from '../src/api';
import { JOB_EVENT_PREFIX } from '../src/jobs';

export const MiB = 2 ** 20;
export const GiB = 2 ** 30;

export function makeJob(fields: Partial<IJob> = {}): IJob {
  return {
    id: 'j1',
    kind: 'save',
    kernel_id: 'k-a',
    snapshot_id: null,
    status: 'running',
    phase: 'dump',
    done: 0,
    total: 100,
    started: 1_000_000,
    finished: null,
    result: null,
    error: null,
    ...fields
  };
}

export function makeSnapshot(fields: Partial<ISnapshotSummary> = {}): ISnapshotSummary {
  return {
    id: 's1',
    name: 'before-training',
    created: 1_000_000,
    created_iso: '1970-01-12T13:46:40+00:00',
    size_bytes: 12.3 * MiB,
    host: 'gpu-1',
    notebook_path: 'work/a.ipynb',
    kernel: { name: 'python3-snapshot', kernel_id: 'k-a' },
    reason: 'user',
    timings: { total: 0.84 },
    gpu: null,
    ...fields
  };
}

/** A snapshot kernel's status: ready, nothing running, no snapshot yet. */
export function makeStatus(fields: Partial<IKernelStatus> = {}): IKernelStatus {
  return {
    kernel_id: 'k-a',
    ready: true,
    reasons: [],
    kernel_name: 'python3-snapshot',
    cuda: null,
    last_snapshot: null,
    job: null,
    ...fields
  };
}

/** The server's refusal of a restore whose ports are taken (error code ports_in_use). */
export function portsRefusal(details: IJobError['details']): IJobError {
  return {
    code: 'ports_in_use',
    step: 'preflight',
    cause: 'shell port 5 of 127.0.0.1 in use',
    message: 'preflight failed: shell port 5 of 127.0.0.1 in use',
    details
  };
}

/**
 * A "language" that writes every message in capitals and leaves what fills its %1
 * placeholders alone, so a test sees which text went through the bundle and which did
 * not. Plurals pick the form as English does.
 */
export class ShoutingBundle implements TranslationBundle {
  /** Every message id asked for, in order. */
  readonly asked: string[] = [];

  gettext(msgid: string, ...args: unknown[]): string {
    this.asked.push(msgid);
    return Gettext.strfmt(msgid.toUpperCase(), ...args);
  }
  ngettext(msgid: string, msgid_plural: string, n: number, ...args: unknown[]): string {
    const chosen = n === 1 ? msgid : msgid_plural;
    this.asked.push(chosen);
    return Gettext.strfmt(chosen.toUpperCase(), n, ...args);
  }
  pgettext(msgctxt: string, msgid: string, ...args: unknown[]): string {
    return this.gettext(msgid, ...args);
  }
  npgettext(
    msgctxt: string,
    msgid: string,
    msgid_plural: string,
    n: number,
    ...args: unknown[]
  ): string {
    return this.ngettext(msgid, msgid_plural, n, ...args);
  }
  dcnpgettext(
    domain: string,
    ...rest: Parameters<TranslationBundle['npgettext']>
  ): string {
    return this.npgettext(...rest);
  }

  // JupyterLab's short names for the same calls.
  readonly __ = this.gettext;
  readonly _n = this.ngettext;
  readonly _p = this.pgettext;
  readonly _np = this.npgettext;
}

export const JOB_SCHEMA = `${JOB_EVENT_PREFIX}v1`;

/** The server's event stream: a real signal the test emits on. */
export class EventStream {
  readonly signal = new Signal<unknown, Event.Emission>(this);
  readonly manager = { stream: this.signal } as unknown as Event.IManager;

  emitJob(job: IJob, schema = JOB_SCHEMA): void {
    this.signal.emit({ schema_id: schema, ...job } as unknown as Event.Emission);
  }
}

/** The text of a React tree, one line per list item or paragraph. */
export function textOf(node: React.ReactNode): string {
  if (node === null || node === undefined || typeof node === 'boolean') {
    return '';
  }
  if (typeof node === 'string' || typeof node === 'number') {
    return String(node);
  }
  if (Array.isArray(node)) {
    return node.map(textOf).join('');
  }
  const element = node as React.ReactElement<{ children?: React.ReactNode }>;
  if (typeof element.type === 'function') {
    const component = element.type as (props: unknown) => React.ReactNode;
    return textOf(component(element.props));
  }
  const inner = textOf(element.props.children);
  return ['li', 'p', 'h3'].includes(element.type as string) ? `${inner}\n` : inner;
}
