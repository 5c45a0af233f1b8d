/**
 * Following a job of the server until it ends.
 *
 * The job is polled; when the server's event stream carries a change of it, that wakes
 * the poll at once, so progress shows without waiting for the next tick.
 */
import type { Event } from '@jupyterlab/services';
import type { IJob, SnapshotAPI } from './api';

/** The server's job event schema (server/event_schemas/job-v1.yaml), any version. */
export const JOB_EVENT_PREFIX = 'https://events.jupyter.org/jupyter_gpu_snapshot/job/';

export function jobFromEvent(event: Event.Emission): IJob | null {
  if (!event.schema_id?.startsWith(JOB_EVENT_PREFIX)) {
    return null;
  }
  // jupyter_server sends the payload's fields beside schema_id.
  const payload = event as unknown as IJob;
  if (typeof payload.id !== 'string' || typeof payload.status !== 'string') {
    return null;
  }
  return payload;
}

export class JobFollower {
  constructor(
    private readonly _api: SnapshotAPI,
    private readonly _events: Event.IManager | null,
    /** Milliseconds between polls of a job (settings: followJobMilliseconds). */
    public interval = 400
  ) {
    this._events?.stream.connect(this._onEvent, this);
  }

  /** Calls ``onChange`` on each new state of the job; resolves with its final state. */
  async follow(job: IJob, onChange: (job: IJob) => void): Promise<IJob> {
    let current = job;
    let failures = 0;
    onChange(current);
    while (current.status === 'running') {
      const fromEvent = await this._wait(current.id);
      try {
        const next = fromEvent ?? (await this._api.getJob(current.id));
        failures = 0;
        if (
          next.status !== current.status ||
          next.phase !== current.phase ||
          next.done !== current.done ||
          next.total !== current.total
        ) {
          current = next;
          onChange(current);
        }
      } catch (error) {
        // A few misses are a busy server; more are a server that is gone.
        if (++failures >= 10) {
          throw error;
        }
      }
    }
    return current;
  }

  dispose(): void {
    this._events?.stream.disconnect(this._onEvent, this);
  }

  private _wait(jobId: string): Promise<IJob | null> {
    return new Promise(resolve => {
      const timer = setTimeout(() => {
        this._waiters.delete(jobId);
        resolve(null);
      }, this.interval);
      this._waiters.set(jobId, job => {
        clearTimeout(timer);
        this._waiters.delete(jobId);
        resolve(job);
      });
    });
  }

  private _onEvent(_: unknown, event: Event.Emission): void {
    const job = jobFromEvent(event);
    if (job) {
      this._waiters.get(job.id)?.(job);
      this.jobEvent?.(job);
    }
  }

  /** Called with every job the event stream reports, followed or not. */
  jobEvent: ((job: IJob) => void) | null = null;

  private _waiters = new Map<string, (job: IJob) => void>();
}
