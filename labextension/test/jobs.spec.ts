/**
 * Following a job of the server: polls at the set interval, reports each new state once,
 * wakes early on the server's job events, and gives up only on a server that stays silent.
 */
import type { Event } from '@jupyterlab/services';
import type { IJob, SnapshotAPI } from '../src/api';
import { JOB_EVENT_PREFIX, JobFollower, jobFromEvent } from '../src/jobs';
import { EventStream, JOB_SCHEMA, makeJob } from './fixtures';

/** The API with its job endpoint answered by ``getJob``; nothing else is called. */
function apiAnswering(getJob: (id: string) => Promise<IJob>): SnapshotAPI {
  return { getJob: jest.fn(getJob) } as unknown as SnapshotAPI;
}

/** Answers polls with ``states`` in turn, then with the last one forever. */
function scripted(...states: IJob[]): jest.Mock<Promise<IJob>, [string]> {
  let next = 0;
  return jest.fn<Promise<IJob>, [string]>(
    async () => states[Math.min(next++, states.length - 1)]
  );
}

beforeEach(() => {
  jest.useFakeTimers();
});

afterEach(() => {
  jest.useRealTimers();
});

describe('JobFollower polling', () => {
  it('polls once per interval while the job runs, and not after it ended', async () => {
    const getJob = scripted(
      makeJob({ done: 10 }),
      makeJob({ done: 20 }),
      makeJob({ status: 'succeeded', phase: 'done', done: 100 })
    );
    const follower = new JobFollower(apiAnswering(getJob), null, 400);
    const following = follower.follow(makeJob(), () => undefined);

    await jest.advanceTimersByTimeAsync(399);
    expect(getJob).not.toHaveBeenCalled();
    await jest.advanceTimersByTimeAsync(1);
    expect(getJob).toHaveBeenCalledTimes(1);
    expect(getJob).toHaveBeenCalledWith('j1');
    await jest.advanceTimersByTimeAsync(400);
    expect(getJob).toHaveBeenCalledTimes(2);
    await jest.advanceTimersByTimeAsync(400);
    await expect(following).resolves.toMatchObject({ status: 'succeeded', done: 100 });
    await jest.advanceTimersByTimeAsync(4000);
    expect(getJob).toHaveBeenCalledTimes(3);
  });

  it('follows a new interval from the next wait on', async () => {
    const getJob = scripted(makeJob({ done: 10 }), makeJob({ status: 'succeeded' }));
    const follower = new JobFollower(apiAnswering(getJob), null, 400);
    follower.interval = 50;
    const following = follower.follow(makeJob(), () => undefined);
    await jest.advanceTimersByTimeAsync(100);
    await expect(following).resolves.toMatchObject({ status: 'succeeded' });
    expect(getJob).toHaveBeenCalledTimes(2);
  });

  it('reports each new state once and resolves with the last', async () => {
    const states = [
      makeJob({ done: 50 }),
      makeJob({ done: 50 }),
      makeJob({ status: 'succeeded', phase: 'done' })
    ];
    const follower = new JobFollower(apiAnswering(scripted(...states)), null, 5);
    const seen: number[] = [];
    const following = follower.follow(makeJob(), current => seen.push(current.done));
    await jest.advanceTimersByTimeAsync(15);
    const final = await following;
    expect(final.status).toBe('succeeded');
    expect(seen).toEqual([0, 50, 0]); // the repeated state is not reported again
  });

  it('reports a change of phase or total even when the bytes stay the same', async () => {
    const getJob = scripted(
      makeJob({ phase: 'dump', done: 0, total: 100 }),
      makeJob({ phase: 'commit', done: 0, total: 100 }),
      makeJob({ phase: 'commit', done: 0, total: 200 }),
      makeJob({ status: 'failed', phase: 'commit', done: 0, total: 200 })
    );
    const follower = new JobFollower(apiAnswering(getJob), null, 10);
    const seen: string[] = [];
    const following = follower.follow(makeJob({ phase: 'dump' }), j =>
      seen.push(`${j.status} ${j.phase} ${j.total}`)
    );
    await jest.advanceTimersByTimeAsync(40);
    await expect(following).resolves.toMatchObject({ status: 'failed' });
    expect(seen).toEqual([
      'running dump 100',
      'running commit 100',
      'running commit 200',
      'failed commit 200'
    ]);
  });

  it('resolves at once with a job that has already finished, without polling', async () => {
    const getJob = scripted(makeJob());
    const follower = new JobFollower(apiAnswering(getJob), null, 10);
    const onChange = jest.fn();
    const done = makeJob({ status: 'succeeded', phase: 'done' });
    await expect(follower.follow(done, onChange)).resolves.toBe(done);
    expect(onChange).toHaveBeenCalledTimes(1);
    expect(onChange).toHaveBeenCalledWith(done);
    await jest.advanceTimersByTimeAsync(100);
    expect(getJob).not.toHaveBeenCalled();
  });
});

describe('JobFollower and a server that does not answer', () => {
  it('rides out a few failed polls', async () => {
    let calls = 0;
    const getJob = jest.fn(async () => {
      calls++;
      if (calls <= 9) {
        throw new Error('502 Bad Gateway');
      }
      return makeJob({ status: 'succeeded', phase: 'done' });
    });
    const follower = new JobFollower(apiAnswering(getJob), null, 10);
    const following = follower.follow(makeJob(), () => undefined);
    await jest.advanceTimersByTimeAsync(100);
    await expect(following).resolves.toMatchObject({ status: 'succeeded' });
    expect(getJob).toHaveBeenCalledTimes(10);
  });

  it('counts only failures in a row: an answer starts the count afresh', async () => {
    // 9 failures, an answer (still running), 9 failures, the end.
    const answers: (IJob | Error)[] = [
      ...Array(9).fill(new Error('timeout')),
      makeJob({ done: 50 }),
      ...Array(9).fill(new Error('timeout')),
      makeJob({ status: 'succeeded', phase: 'done', done: 100 })
    ];
    const getJob = jest.fn(async () => {
      const answer = answers.shift()!;
      if (answer instanceof Error) {
        throw answer;
      }
      return answer;
    });
    const follower = new JobFollower(apiAnswering(getJob), null, 10);
    const following = follower.follow(makeJob(), () => undefined);
    await jest.advanceTimersByTimeAsync(200);
    await expect(following).resolves.toMatchObject({ status: 'succeeded', done: 100 });
    expect(getJob).toHaveBeenCalledTimes(20);
  });

  it('ends the follow with the error after ten failed polls in a row', async () => {
    const getJob = jest.fn(async () => {
      throw new Error('cannot reach the Jupyter server');
    });
    const follower = new JobFollower(apiAnswering(getJob), null, 10);
    const following = follower.follow(makeJob(), () => undefined);
    const outcome = expect(following).rejects.toThrow(/cannot reach/);
    await jest.advanceTimersByTimeAsync(100);
    await outcome;
    expect(getJob).toHaveBeenCalledTimes(10);
    await jest.advanceTimersByTimeAsync(100);
    expect(getJob).toHaveBeenCalledTimes(10);
  });
});

describe('JobFollower and the server events', () => {
  it('takes the state from an event before its next poll', async () => {
    const events = new EventStream();
    const getJob = jest.fn(async (): Promise<IJob> => {
      throw new Error('polled although the event came first');
    });
    const follower = new JobFollower(apiAnswering(getJob), events.manager, 60_000);
    const foreign: string[] = [];
    follower.jobEvent = job => foreign.push(job.id);
    const seen: string[] = [];
    const following = follower.follow(makeJob(), j => seen.push(`${j.status} ${j.done}`));

    events.emitJob(makeJob({ id: 'other' }));
    events.emitJob(makeJob({ done: 60 }));
    await jest.advanceTimersByTimeAsync(0);
    events.emitJob(makeJob({ status: 'failed', phase: 'dump', done: 60 }));
    const final = await following;

    expect(final.status).toBe('failed');
    expect(seen).toEqual(['running 0', 'running 60', 'failed 60']);
    expect(foreign).toEqual(['other', 'j1', 'j1']);
    expect(getJob).not.toHaveBeenCalled();
    follower.dispose();
  });

  it('ignores events of other schemas and events without a job', async () => {
    const events = new EventStream();
    const getJob = scripted(makeJob({ status: 'succeeded', phase: 'done' }));
    const follower = new JobFollower(apiAnswering(getJob), events.manager, 1000);
    const jobEvent = jest.fn();
    follower.jobEvent = jobEvent;
    const following = follower.follow(makeJob(), () => undefined);

    events.emitJob(
      makeJob({ status: 'failed' }),
      'https://events.jupyter.org/jupyter_server/kernel_actions/v1'
    );
    events.signal.emit({
      schema_id: JOB_SCHEMA,
      status: 'failed'
    } as unknown as Event.Emission);
    await jest.advanceTimersByTimeAsync(1000);

    await expect(following).resolves.toMatchObject({ status: 'succeeded' });
    expect(getJob).toHaveBeenCalledTimes(1);
    expect(jobEvent).not.toHaveBeenCalled();
  });

  it('stops listening once disposed', () => {
    const events = new EventStream();
    const follower = new JobFollower(apiAnswering(scripted(makeJob())), events.manager);
    const jobEvent = jest.fn();
    follower.jobEvent = jobEvent;
    events.emitJob(makeJob({ id: 'before' }));
    follower.dispose();
    events.emitJob(makeJob({ id: 'after' }));
    expect(jobEvent.mock.calls.map(([job]) => job.id)).toEqual(['before']);
  });
});

describe('jobFromEvent', () => {
  const emission = (fields: object) => fields as unknown as Event.Emission;

  it('reads a job from any version of the job schema', () => {
    const job = makeJob({ id: 'j9' });
    expect(jobFromEvent(emission({ schema_id: JOB_SCHEMA, ...job }))).toMatchObject(job);
    expect(
      jobFromEvent(emission({ schema_id: `${JOB_EVENT_PREFIX}v2`, ...job }))?.id
    ).toBe('j9');
  });

  it('rejects other schemas and payloads without an id or a status', () => {
    const job = makeJob();
    expect(
      jobFromEvent(emission({ schema_id: 'https://example.org/job/v1', ...job }))
    ).toBeNull();
    expect(jobFromEvent(emission({ ...job }))).toBeNull();
    expect(
      jobFromEvent(emission({ schema_id: JOB_SCHEMA, status: 'running' }))
    ).toBeNull();
    expect(
      jobFromEvent(emission({ schema_id: JOB_SCHEMA, id: 'j1', status: 3 }))
    ).toBeNull();
  });
});
